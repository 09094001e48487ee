"""Where tensor bytes come from, behind one small interface.

The tree and the FUSE layer only ever call ``ByteSource.read_into(file, offset,
buffer)``; ``LocalFiles`` serves local files today, and an HTTP or object-store
range reader can implement the same interface.

Reads use ``preadv`` straight into the caller's buffer (libfuse's, in the
daemon): one copy from the page cache, like a ``memmove`` out of a memory map,
but a source truncated under the mount gives a short read (EIO) where a mapping
would raise SIGBUS and kill the daemon.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from dataclasses import dataclass
from typing import Protocol

from cachetools import LRUCache

from .format import header_digest

log = logging.getLogger(__name__)

DEFAULT_MAX_OPEN_FILES = 256


class SourceChanged(OSError):
    """A source no longer holds the bytes it was mounted with (maps to EIO)."""


class ByteSource(Protocol):
    def read_into(self, file: str, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` with the bytes of ``file`` at ``offset``; return the count, short only at its end."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Expectation:
    """What a source file looked like when it was validated."""

    header_length: int
    digest: bytes


class _OpenFile:
    __slots__ = ("fd", "identity", "changed", "users", "evicted")

    def __init__(self, fd: int, identity: tuple[int, int, int]) -> None:
        self.fd = fd
        self.identity = identity  # (inode, size, mtime) last seen holding the expected header
        self.changed = False
        self.users = 0  # reads in flight: an evicted descriptor is closed by its last user
        self.evicted = False

    def release(self) -> None:
        if self.evicted and self.users == 0:
            os.close(self.fd)


class _ClosingLRU(LRUCache):
    def popitem(self) -> tuple[str, _OpenFile]:
        key, handle = super().popitem()
        handle.evicted = True
        handle.release()
        return key, handle


class LocalFiles:
    """Local files read with ``preadv``; at most ``max_open`` descriptors stay open (least recently used go)."""

    def __init__(self, expected: dict[str, Expectation], max_open: int = DEFAULT_MAX_OPEN_FILES) -> None:
        self._expected = expected
        self._open: _ClosingLRU = _ClosingLRU(maxsize=max_open)
        self._lock = threading.Lock()

    def read_into(self, file: str, offset: int, buffer: memoryview) -> int:
        handle = self._acquire(file)
        try:
            self._verify(file, handle)
            done = 0
            while done < len(buffer):
                count = os.preadv(handle.fd, [buffer[done:]], offset + done)
                if count == 0:
                    raise SourceChanged(f"{file} ends at byte {offset + done}: truncated since it was mounted")
                done += count
            # Checked again after the read: a rewrite that landed during it (a writer puts the new header
            # first) must fail this read too, not hand out new bytes as the mounted tensor's.
            self._verify(file, handle)
            return done
        finally:
            with self._lock:
                handle.users -= 1
                handle.release()

    def _verify(self, file: str, handle: _OpenFile) -> None:
        stat = os.fstat(handle.fd)
        if (stat.st_ino, stat.st_size, stat.st_mtime_ns) != handle.identity:
            with self._lock:
                self._recheck(file, handle, stat)
        if handle.changed:
            raise SourceChanged(f"{file} was replaced or rewritten since it was mounted")

    def _acquire(self, file: str) -> _OpenFile:
        with self._lock:
            handle = self._open.get(file)
            if handle is None:
                fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    stat = os.fstat(fd)
                    handle = _OpenFile(fd, (stat.st_ino, stat.st_size, stat.st_mtime_ns))
                    self._recheck(file, handle, stat)
                except BaseException:
                    os.close(fd)  # a failed header read must not leak the descriptor
                    raise
                self._open[file] = handle
            handle.users += 1
            return handle

    def _recheck(self, file: str, handle: _OpenFile, stat: os.stat_result) -> None:
        expected = self._expected.get(file)
        if expected is not None and not handle.changed:
            head = os.pread(handle.fd, 8 + expected.header_length, 0)
            same = (
                len(head) == 8 + expected.header_length
                and struct.unpack("<Q", head[:8])[0] == expected.header_length
                and header_digest(head[8:]) == expected.digest
            )
            if not same:
                log.error("%s: header differs from the one mounted; its reads now fail with EIO", file)
                handle.changed = True
        handle.identity = (stat.st_ino, stat.st_size, stat.st_mtime_ns)

    def close(self) -> None:
        with self._lock:
            while self._open:
                self._open.popitem()
