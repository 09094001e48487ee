"""Fetched pieces of remote files kept on disk across mounts (``--cache-dir``), within a bound (``--cache-dir-size``).

A piece is a file ``DIR/<hash of key and version>/<lo>-<hi>``: keyed by object *and* version, so a
changed object never hits an old piece. Written to a temporary name and renamed into place, so two
daemons sharing DIR never see half a piece; a piece found is read whole or ignored.

The bound holds across every daemon that shares DIR, through one small file, ``DIR/.stfs-usage``: the bytes
of pieces DIR holds, read and written under an exclusive ``flock`` of it. A daemon that would take DIR past
the bound first deletes the least recently used pieces (a piece's mtime is set each time one is read), never
one that a daemon is reading: a reader holds a shared ``flock`` of the piece while it reads, and a piece is
deleted only under an exclusive one, taken without waiting. Each daemon writes one piece at a time, so DIR
holds at most the bound plus one piece being written per daemon. A full disk (ENOSPC) stops the writing, with
one log line; reads go on from memory and from the pieces already kept.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 10 << 30
USAGE_FILE = ".stfs-usage"
STALE_TEMPORARY = 600.0  # seconds: a temporary piece this old was left by a daemon that died writing it


class DiskCache:
    """Pieces ``[lo, hi)`` of versioned objects under ``folder``, at most ``max_bytes`` of them."""

    def __init__(self, folder: str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.folder = os.path.abspath(folder)
        self.max_bytes = max_bytes
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), self.folder)
        os.makedirs(self.folder, exist_ok=True)
        os.close(os.open(os.path.join(self.folder, USAGE_FILE), os.O_RDWR | os.O_CREAT, 0o600))  # writable here?
        self._writing = threading.Lock()  # one piece at a time from this daemon (flock does not exclude threads)
        self.full = False  # the disk was full: no more pieces are written

    def _path(self, key: str, version: str, lo: int, hi: int) -> str:
        digest = hashlib.sha256(f"{key}\0{version}".encode("utf-8", "surrogateescape")).hexdigest()[:40]
        return os.path.join(self.folder, digest, f"{lo}-{hi}")

    def get(self, key: str, version: str, lo: int, hi: int) -> bytes | None:
        """The piece ``[lo, hi)`` of ``key`` at ``version``, if some daemon kept it; it becomes the most recent."""
        if not version:
            return None  # without a version a piece could be of any version: never kept, never used
        path = self._path(key, version, lo, hi)
        try:
            with open(path, "rb") as stream:
                fcntl.flock(stream, fcntl.LOCK_SH)  # not deleted while read (an evictor's LOCK_EX fails)
                data = stream.read(hi - lo + 1)
                with contextlib.suppress(OSError):
                    os.utime(stream.fileno())  # least recently used goes first: this one was just used
        except OSError:
            return None
        return data if len(data) == hi - lo else None

    def put(self, key: str, version: str, lo: int, hi: int, data: bytes | memoryview) -> None:
        """Keep a piece, making room for it; failures (a full disk) are logged, never raised: the cache is an
        optimisation."""
        if not version or self.full or len(data) > self.max_bytes:
            return
        path = self._path(key, version, lo, hi)
        with self._writing:
            if self.full:  # found full by a put that held the lock meanwhile: one log line, not one per put
                return
            temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            try:
                if os.path.exists(path):
                    return
                self._write(temporary, data)
                with self._usage() as usage:
                    total = usage.read()
                    if os.path.exists(path):  # another daemon kept it meanwhile
                        return
                    if total + len(data) > self.max_bytes:
                        total = self._evict(self.max_bytes - len(data))
                    os.replace(temporary, path)
                    usage.write(total + len(data))
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    self.full = True
                    log.warning("%s is full: fetched blocks are kept in memory only from now on (%s)", self.folder, exc)
                else:
                    log.warning("cannot keep a piece of %s in %s: %s", key, self.folder, exc)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)

    @staticmethod
    def _write(temporary: str, data: bytes | memoryview) -> None:
        for attempt in (1, 2):
            os.makedirs(os.path.dirname(temporary), exist_ok=True)
            try:
                with open(temporary, "wb") as stream:
                    stream.write(data)
                return
            except FileNotFoundError:  # another daemon evicted the object's last piece, and its folder, just now
                if attempt == 2:
                    raise

    def usage(self) -> int:
        """The bytes of pieces DIR holds, as the daemons sharing it count them."""
        with self._usage() as usage:
            return usage.read()

    @contextlib.contextmanager
    def _usage(self) -> Iterator[_Usage]:
        """The shared count, held under an exclusive lock for the ``with`` block."""
        fd = os.open(os.path.join(self.folder, USAGE_FILE), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            usage = _Usage(fd)
            if usage.read() < 0:  # a new folder, or one kept before the count existed: count it once
                usage.write(sum(size for _, size, _ in self._pieces()))
            yield usage
        finally:
            os.close(fd)  # releases the lock

    def _evict(self, target: int) -> int:
        """Delete the least recently used pieces until at most ``target`` bytes are kept; the bytes kept.

        Called under the usage lock. A piece a daemon is reading (its shared lock held) is skipped."""
        pieces = sorted(self._pieces())
        total = sum(size for _, size, _ in pieces)
        for _, size, path in pieces:
            if total <= target:
                break
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                total -= size
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.unlink(path)
            except OSError:  # BlockingIOError: being read right now, not this one
                continue
            finally:
                os.close(fd)
            total -= size
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(path))  # the object's last piece: its folder goes too
        return max(total, 0)

    def _pieces(self) -> Iterator[tuple[float, int, str]]:
        """(mtime, size, path) of every piece kept; temporary pieces left by a dead daemon are deleted."""
        now = time.time()
        with os.scandir(self.folder) as objects:
            for entry in objects:
                if not entry.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(OSError), os.scandir(entry.path) as pieces:
                    for piece in pieces:
                        with contextlib.suppress(OSError):
                            info = piece.stat(follow_symlinks=False)
                            if piece.name.endswith(".tmp"):
                                if now - info.st_mtime > STALE_TEMPORARY:
                                    os.unlink(piece.path)
                                continue
                            yield info.st_mtime, info.st_size, piece.path


class _Usage:
    """The count in ``DIR/.stfs-usage``: decimal bytes; ``-1`` when there is none yet."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read(self) -> int:
        text = os.pread(self.fd, 32, 0).strip()
        return int(text) if text.isdigit() else -1

    def write(self, total: int) -> None:
        data = f"{total}\n".encode()
        os.pwrite(self.fd, data, 0)
        os.ftruncate(self.fd, len(data))
