"""Local files as a byte source.

``LocalFiles`` never maps a source: a source truncated under the mount gives
a short read (EIO) where a mapping would raise SIGBUS and kill the daemon.
Bytes reach the kernel one of two ways:

* ``splice_into`` puts the source's page-cache pages into a pipe by
  reference; libfuse splices that pipe into /dev/fuse, where the kernel copies
  each page once, into the mount's page cache. No copy in user space.
* ``read_into`` fills the caller's buffer (libfuse's) with ``preadv``: one
  copy there, and the kernel's copy out of that buffer.

Drop-behind: a page served into the mount's page cache (``kernel_cache``)
is never asked for again, so its twin in the source's page cache is dead
weight — two copies of the model in RAM. ``LocalFiles`` follows each run of
contiguous reads and drops (``POSIX_FADV_DONTNEED``) the source's 2 MiB
chunks that lie ``DROP_LAG`` behind the newest read; a run that ends is
dropped whole once newer runs push it out. The price: another process reading
the *source* directly finds those pages gone and reads them again from disk.
``drop_behind=False`` (``stfs mount --keep-source-cache``) keeps them.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from stat import S_ISDIR, S_ISREG

from cachetools import LRUCache

from ..format import Header, header_digest
from .base import PAGE, FileInfo, Kind, SourceChanged

log = logging.getLogger(__name__)

DEFAULT_MAX_OPEN_FILES = 256
DROP_CHUNK = 2 << 20  # drop in 2 MiB-aligned pieces: a page straddling two requests goes too
DROP_LAG = 2 << 20  # stay this far behind a run's newest byte: its pages may still sit in a pipe
THREADED_DROP_LAG = 16 << 20  # with a thread pool, requests finish out of order and more are in flight
MAX_RUNS = 8  # contiguous read runs followed per source file
SMALL_RUN = 64 << 10  # reads shorter than this that continue no run are not followed (nor dropped)


@dataclass(frozen=True, slots=True)
class Expectation:
    """What a source file looked like when it was validated."""

    header_length: int
    digest: bytes

    @classmethod
    def of(cls, header: Header) -> Expectation:
        return cls(header_length=header.header_length, digest=header.digest)


class _OpenFile:
    __slots__ = ("fd", "inode", "size", "mtime_ns", "changed", "users", "evicted", "runs")

    def __init__(self, fd: int, stat: os.stat_result) -> None:
        self.fd = fd
        self.inode, self.size, self.mtime_ns = stat.st_ino, stat.st_size, stat.st_mtime_ns  # last seen, checked
        self.changed = False
        self.users = 0  # reads in flight: an evicted descriptor is closed by its last user
        self.evicted = False
        self.runs: list[list[int]] = []  # [start, end) of recent contiguous reads, newest last

    def close(self) -> None:
        for start, end in self.runs:
            _drop(self.fd, start, end)
        self.runs.clear()
        os.close(self.fd)


def _drop(fd: int, start: int, end: int) -> None:
    """Drop the source's cached pages of [start, end), rounded out to whole pages."""
    first = start - start % PAGE
    last = -(-end // PAGE) * PAGE  # DONTNEED keeps a partial page at either end; round out
    try:
        os.posix_fadvise(fd, first, last - first, os.POSIX_FADV_DONTNEED)
    except OSError as exc:  # advice only: never fail a read over it
        log.debug("posix_fadvise failed: %s", exc)


class _ClosingLRU(LRUCache):
    def popitem(self) -> tuple[str, _OpenFile]:
        key, handle = super().popitem()
        handle.evicted = True
        if not handle.users:
            handle.close()
        return key, handle


class LocalFiles:
    """Local files read with ``preadv`` or ``splice``; at most ``max_open`` descriptors stay open (LRU)."""

    first_read = 8

    def __init__(
        self,
        expected: dict[str, Expectation] | None = None,
        max_open: int = DEFAULT_MAX_OPEN_FILES,
        drop_behind: bool = True,
        threaded: bool = True,
    ) -> None:
        self._expected = dict(expected or {})
        self.max_open = max_open
        self._open: _ClosingLRU = _ClosingLRU(maxsize=max_open)
        self._lock = threading.Lock()
        self.drop_behind = drop_behind
        # A single-threaded daemon skips the lock: two uncontended acquisitions are a tenth of a 4 KiB read.
        self.threaded = threaded
        self._lag = THREADED_DROP_LAG if threaded else DROP_LAG

    def kind(self, key: str) -> Kind | None:
        try:
            mode = os.stat(key).st_mode
        except FileNotFoundError:
            return Kind.OTHER if os.path.lexists(key) else None  # a dangling link
        except ValueError:  # a NUL in the name: no such file can exist
            return None
        except OSError:
            return Kind.OTHER
        return Kind.FOLDER if S_ISDIR(mode) else Kind.FILE if S_ISREG(mode) else Kind.OTHER

    def walk(self, folder: str) -> list[str]:
        keys = []
        for parent, subfolders, names in os.walk(folder):
            subfolders.sort()
            keys += [os.path.join(parent, name) for name in names]
        return sorted(keys)

    def stat(self, key: str) -> FileInfo:
        info = os.stat(key)
        version = f"{info.st_dev}:{info.st_ino}:{info.st_size}:{info.st_mtime_ns}"
        return FileInfo(key=key, size=info.st_size, mtime_ns=info.st_mtime_ns, version=version)

    def read(self, key: str, offset: int, size: int) -> bytes:
        fd = os.open(key, os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks = []
            while size > 0:
                chunk = os.pread(fd, min(size, 1 << 30), offset)
                if not chunk:
                    break
                chunks.append(chunk)
                size -= len(chunk)
                offset += len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def expect(self, key: str, expectation: Expectation) -> None:
        """Check from now on that ``key`` still has the header it was validated with."""
        self._expected[key] = expectation

    def read_into(self, file: str, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` with the bytes of ``file`` at ``offset``; return its length."""
        view = buffer if buffer.format == "B" else buffer.cast("B")
        return self._transfer(file, offset, len(view), lambda fd, done: os.preadv(fd, [view[done:]], offset + done))

    def splice_into(self, file: str, offset: int, count: int, pipe: int) -> int:
        """Move ``count`` bytes of ``file`` at ``offset`` into the pipe ``pipe`` (non-blocking) by reference.

        Returns the count moved: short only when the pipe is full, and the caller then drains it. (The pipe
        holds the pages themselves; a writer overwriting them in place in the few microseconds until libfuse
        copies them out is not caught. Truncating first, as writers do, detaches them.)
        """
        return self._transfer(
            file, offset, count, lambda fd, done: os.splice(fd, pipe, count - done, offset_src=offset + done)
        )

    def _transfer(self, file: str, offset: int, count: int, step: Callable[[int, int], int]) -> int:
        """Run ``step(fd, done)`` until ``count`` bytes moved (or a pipe is full), then check the source.

        The check comes *after* the bytes moved: a source truncated or rewritten before the read or
        during it fails it alike (a writer puts the new header first), so new bytes are never handed
        out as the mounted tensor's, and a check before it would only repeat the ``fstat``.
        """
        handle = self._acquire(file)
        done = 0
        try:
            while done < count:
                try:
                    moved = step(handle.fd, done)
                except BlockingIOError:  # the pipe is full
                    break
                if moved == 0:
                    raise SourceChanged(f"{file} ends at byte {offset + done}: truncated since it was mounted")
                done += moved
            self._verify(file, handle, offset + count)
            return done
        finally:
            self._release(handle, offset, done)

    def _acquire(self, file: str) -> _OpenFile:
        """The open descriptor of ``file`` (opened, and its header checked, if it was not)."""
        threaded = self.threaded
        if threaded:
            self._lock.acquire()
        try:
            handle = self._open.get(file)
            if handle is None:
                handle = self._open_file(file)
            handle.users += 1
        finally:
            if threaded:
                self._lock.release()
        return handle

    def _verify(self, file: str, handle: _OpenFile, end: int) -> None:
        """Raise ``SourceChanged`` unless ``file`` still has its mounted header and at least ``end`` bytes."""
        stat = os.fstat(handle.fd)
        if stat.st_mtime_ns != handle.mtime_ns or stat.st_size != handle.size or stat.st_ino != handle.inode:
            with self._lock:
                self._recheck(file, handle, stat)
        if handle.changed:
            raise SourceChanged(f"{file} was replaced or rewritten since it was mounted")
        if end > stat.st_size:
            raise SourceChanged(f"{file} is {stat.st_size} bytes: truncated since it was mounted")

    def _open_file(self, file: str) -> _OpenFile:
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
        try:
            stat = os.fstat(fd)
            handle = _OpenFile(fd, stat)
            self._recheck(file, handle, stat)
        except BaseException:
            os.close(fd)
            raise
        self._open[file] = handle  # may evict (and close) the least recently used
        return handle

    def _release(self, handle: _OpenFile, offset: int, count: int) -> None:
        threaded = self.threaded
        if threaded:
            self._lock.acquire()
        try:
            if count and self.drop_behind:
                self._served(handle, offset, offset + count, self._lag)
            handle.users -= 1
            if handle.evicted and not handle.users:
                handle.close()
        finally:
            if threaded:
                self._lock.release()

    @staticmethod
    def _served(handle: _OpenFile, start: int, end: int, lag: int) -> None:
        """Note that [start, end) went to the mount's page cache; drop what lies far enough behind.

        A read that continues a run, or lands a little behind it (a thread pool finishes requests out
        of order; readers racing through one file split the kernel's readahead), joins it; any other
        starts a run, unless it is short: runs that end short are not dropped anyway (a syscall per
        random 4 KiB read would cost more than the page), so following them would only cost time.
        The pages of the read itself are still in the pipe to libfuse, so they go with a later cut.
        """
        runs = handle.runs
        for index in range(len(runs) - 1, -1, -1):
            run = runs[index]
            if run[0] - lag <= start <= run[1]:
                if start < run[0]:
                    run[0] = start
                if end > run[1]:
                    run[1] = end
                    for other in runs[:]:  # runs that now meet (out-of-order requests) become one
                        if other is not run and other[0] - lag <= run[1] and run[0] - lag <= other[1]:
                            run[0], run[1] = min(run[0], other[0]), max(run[1], other[1])
                            runs.remove(other)
                cut = (run[1] - lag) // DROP_CHUNK * DROP_CHUNK
                if cut - run[0] >= DROP_CHUNK:
                    _drop(handle.fd, run[0], cut)
                    run[0] = cut
                return
        if end - start < SMALL_RUN:
            return
        runs.append([start, end])
        if len(runs) > MAX_RUNS:
            old_start, old_end = runs.pop(0)
            _drop(handle.fd, old_start, old_end)

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
        handle.inode, handle.size, handle.mtime_ns = stat.st_ino, stat.st_size, stat.st_mtime_ns

    def open_count(self) -> int:
        """Descriptors open now (for tests and diagnosis)."""
        with self._lock:
            return len(self._open)

    def close(self) -> None:
        with self._lock:
            while self._open:
                self._open.popitem()
