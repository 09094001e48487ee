"""Local files as a byte source.

``LocalFiles`` never maps a source: a source truncated under the mount gives
a short read (EIO) where a mapping would raise SIGBUS and kill the daemon.
It holds every source open from the moment it is validated (``LocalFiles``'s
docstring has the snapshot rule). Bytes reach the kernel one of two ways:

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

import errno
import logging
import os
import resource
import threading
from collections.abc import Callable
from stat import S_ISDIR, S_ISREG
from typing import NoReturn

from cachetools import LRUCache

from .base import PAGE, FileInfo, Kind, SourceChanged

log = logging.getLogger(__name__)

RESERVED_DESCRIPTORS = 128  # kept free of sources: /dev/fuse, pipes, logs, libfuse's own
DROP_CHUNK = 2 << 20  # drop in 2 MiB-aligned pieces: a page straddling two requests goes too
DROP_LAG = 2 << 20  # stay this far behind a run's newest byte: its pages may still sit in a pipe
THREADED_DROP_LAG = 16 << 20  # with a thread pool, requests finish out of order and more are in flight
MAX_RUNS = 8  # contiguous read runs followed per source file
SMALL_RUN = 64 << 10  # reads shorter than this that continue no run are not followed (nor dropped)
# Set by `stfs csi` (SPEC §15a): the folders, os.pathsep apart, that every file served must resolve into; a symbolic
# link below an allowed folder that leads out of them is neither listed nor opened
ROOTS_VARIABLE = "STFS_LOCAL_ROOTS"


def confined_roots() -> tuple[str, ...] | None:
    """The folders ``ROOTS_VARIABLE`` names (resolved), or None where it is not set: every file may be served."""
    value = os.environ.get(ROOTS_VARIABLE)
    if value is None:
        return None
    return tuple(os.path.realpath(folder) for folder in value.split(os.pathsep) if folder)


def inside(path: str, roots: tuple[str, ...]) -> bool:
    """Whether the resolved ``path`` is one of ``roots`` or lies below one."""
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def descriptor_budget() -> int:
    """How many sources may stay open: the soft ``RLIMIT_NOFILE``, raised to the hard limit, less a reserve."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as exc:
            log.debug("cannot raise RLIMIT_NOFILE to %s: %s", hard, exc)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, soft - RESERVED_DESCRIPTORS)


class _Pin:
    """A source file as it was when first opened: the version every read of it must still find."""

    __slots__ = ("key", "device", "inode", "size", "mtime_ns", "changed")

    def __init__(self, key: str, stat: os.stat_result) -> None:
        self.key = key
        self.device, self.inode, self.size, self.mtime_ns = stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns
        self.changed = False  # once seen, a change lasts for the life of the mount

    def holds(self, stat: os.stat_result) -> bool:
        """Whether ``stat`` describes the pinned file, unchanged."""
        return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns) == (
            self.device,
            self.inode,
            self.size,
            self.mtime_ns,
        )

    @property
    def version(self) -> str:
        return f"{self.device}:{self.inode}:{self.size}:{self.mtime_ns}"


class _OpenFile:
    __slots__ = ("fd", "pin", "users", "evicted", "runs")

    def __init__(self, fd: int, pin: _Pin) -> None:
        self.fd = fd
        self.pin = pin
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
    """Local files, each pinned when first opened and read with ``preadv`` or ``splice``.

    A mount is a snapshot: a file is opened (and pinned: device, inode, size, mtime) the first time
    it is stat'ed or read, which for a model's files is when they are validated, and the descriptor
    is held until the mount ends. A file renamed over or deleted is still served from it; a file
    changed in place (size or mtime differ from the pin) fails every read with ``SourceChanged``.
    Only past ``max_open`` descriptors (default: what ``RLIMIT_NOFILE`` allows, ``descriptor_budget``)
    are the least recently used closed; such a file is reopened by path only if the path still holds
    the pinned file, else its reads fail too.
    """

    first_read = 8
    remote = False
    concurrency = 1
    warnings: tuple[str, ...] = ()

    def __init__(self, max_open: int | None = None, drop_behind: bool = True, threaded: bool = True) -> None:
        self.max_open = descriptor_budget() if max_open is None else max_open
        self._pins: dict[str, _Pin] = {}
        self._open: _ClosingLRU = _ClosingLRU(maxsize=self.max_open)
        self._lock = threading.Lock()
        self._reported: set[str] = set()
        self.drop_behind = drop_behind
        # A single-threaded daemon skips the lock: two uncontended acquisitions are a tenth of a 4 KiB read.
        self.threaded = threaded
        self._lag = THREADED_DROP_LAG if threaded else DROP_LAG
        self.roots = confined_roots()

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
        if self.roots is not None:
            keys = [key for key in keys if inside(os.path.realpath(key), self.roots)]
        return sorted(keys)

    def stat(self, key: str) -> FileInfo:
        """The pinned version of ``key`` (opening and pinning it now if it was not)."""
        handle = self._acquire(key)
        try:
            pin = handle.pin
            return FileInfo(key=key, size=pin.size, mtime_ns=pin.mtime_ns, version=pin.version)
        finally:
            self._release(handle, 0, 0)

    def descriptor(self, key: str) -> tuple[int, int, int] | None:
        """The descriptor ``key`` is read from and its pinned size and ``st_mtime_ns`` (pinning it now if it was
        not); ``None`` once it has changed. For a reader of its own (stfs._native) that keeps the snapshot rule:
        it duplicates the descriptor and checks size and mtime after every read, as ``_transfer`` does."""
        try:
            handle = self._acquire(key)
        except (OSError, SourceChanged):
            return None
        try:
            return handle.fd, handle.pin.size, handle.pin.mtime_ns
        finally:
            self._release(handle, 0, 0)

    @property
    def drop_lag(self) -> int:
        """How far behind a run of reads its source pages are dropped (0: they are kept)."""
        return self._lag if self.drop_behind else 0

    def read(self, key: str, offset: int, size: int) -> bytes:
        handle = self._acquire(key)
        try:
            chunks = []
            end = min(offset + size, handle.pin.size)
            while offset < end:
                chunk = os.pread(handle.fd, min(end - offset, 1 << 30), offset)
                if not chunk:
                    break
                chunks.append(chunk)
                offset += len(chunk)
            self._verify(handle)
            return b"".join(chunks)
        finally:
            self._release(handle, offset, 0)

    def changed(self) -> list[str]:
        """The keys of pinned files whose path no longer holds the pinned file (changed, replaced, deleted)."""
        changed = []
        for key, pin in list(self._pins.items()):
            try:
                now = os.stat(key)
            except OSError:
                changed.append(key)
                continue
            if pin.changed or not pin.holds(now):
                changed.append(key)
        return sorted(changed)

    def read_into(self, file: str, offset: int, buffer: memoryview, span: tuple[int, int] | None = None) -> int:
        """Fill ``buffer`` with the bytes of ``file`` at ``offset``; return its length."""
        view = buffer if buffer.format == "B" else buffer.cast("B")
        return self._transfer(file, offset, len(view), lambda fd, done: os.preadv(fd, [view[done:]], offset + done))

    def splice_into(self, file: str, offset: int, count: int, pipe: int, span: tuple[int, int] | None = None) -> int:
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

        The check comes *after* the bytes moved: a source changed before the read or during it fails
        it alike, so new bytes are never handed out as the mounted ones.
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
                    self._changed(handle.pin, f"it ends at byte {offset + done}")
                done += moved
            self._verify(handle)
            return done
        finally:
            self._release(handle, offset, done)

    def _acquire(self, file: str) -> _OpenFile:
        """The open descriptor of ``file``: held since it was pinned, or (re)opened and checked now."""
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
        if handle.pin.changed:
            self._release(handle, 0, 0)
            raise SourceChanged(f"{file} has changed since it was mounted")
        return handle

    def _open_file(self, file: str) -> _OpenFile:
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if self.roots is not None and not inside(os.readlink(f"/proc/self/fd/{fd}"), self.roots):
                raise PermissionError(errno.EACCES, "it leads out of the folders this mount may read", file)
            stat = os.fstat(fd)
            pin = self._pins.get(file)
            if pin is None:
                pin = self._pins[file] = _Pin(file, stat)
            elif not pin.holds(stat):  # reopened after its descriptor was closed for room: must be the same file
                self._changed(pin, "its path holds another file now")
        except BaseException:
            os.close(fd)
            raise
        handle = _OpenFile(fd, pin)
        self._open[file] = handle  # may evict (and close) the least recently used
        return handle

    def _verify(self, handle: _OpenFile) -> None:
        """Raise ``SourceChanged`` unless the file is still the size and age it was pinned at."""
        stat = os.fstat(handle.fd)
        pin = handle.pin
        if stat.st_size != pin.size or stat.st_mtime_ns != pin.mtime_ns:
            self._changed(pin, f"it is now {stat.st_size} bytes, modified at {stat.st_mtime_ns} ns")

    def _changed(self, pin: _Pin, detail: str) -> NoReturn:
        """Mark ``pin``'s file changed for good, log it once, and fail the read at hand."""
        pin.changed = True
        if pin.key not in self._reported:
            self._reported.add(pin.key)
            log.error("%s changed since it was mounted (%s); its reads now fail with EIO", pin.key, detail)
        raise SourceChanged(f"{pin.key} has changed since it was mounted ({detail})")

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

    def listed_sha256(self, key: str) -> str | None:
        """None: a local file's sha256 is had only by reading it."""
        return None

    def open_count(self) -> int:
        """Descriptors open now (for tests and diagnosis)."""
        with self._lock:
            return len(self._open)

    def close(self) -> None:
        with self._lock:
            while self._open:
                self._open.popitem()
