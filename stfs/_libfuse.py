"""The C side of the FUSE layer: libfuse3 through mfusepy, and stfs._native in front of it.

Nothing here knows what a tensor is, and nothing here packs a C structure: mfusepy's callbacks call the plain
``Operations`` methods of ``fs.StfsOperations`` (``getattr`` a dict, ``readdir`` a list, ``read`` bytes), and
where it is built, ``stfs._native`` (stfs/_native.c) answers the requests that carry the load in C, before
them: C functions installed in the operations table (``native_start``) answer getattr, opendir (the folder's inode
in the handle, so readdir looks up no path), readdir, open/release, statfs, and ``read_buf`` of files that are one
``Range`` of a local source, from tables built once at mount (releasedir and flush have no Python callback: libfuse
answers them itself); of a remote source, reads of bytes its block cache holds and has published to C
(``Published``), spliced from the cache's memfd.

A read C does not answer (a remote source, ``Decoded`` pieces, bytes held in memory, a ``Summary``, a source
whose descriptor C does not hold, any failure) comes back to ``Reader``, which says what the reply holds, in
pieces: ``Range`` pieces spliced by the source into C's pipe for this thread (the kernel's one copy is into the
mount's page cache), ``Decoded`` pieces decoded into the thread's scratch pages and lent to the same pipe by
``vmsplice``, bytes copied. C makes the ``fuse_bufvec`` of them.

Without the extension (built without a compiler or the libfuse3 headers), or with ``STFS_NATIVE=0``, every
request is mfusepy's plain callback: slower, the same answers.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import importlib
import logging
import mmap
import os
import re
import stat
import threading
from collections.abc import Callable
from typing import Any, Protocol

import mfusepy

from . import errors, stopping
from .failed_reads import FailedReads
from .nodes import Decoded, DirNode, FileNode, Gathered, Lowered, Node, Range, ShardData, clamp, lower, pieces
from .readahead import Readahead
from .sources import PAGE, ByteSource, SpliceSource
from .stats import Stats, counted, from_environment
from .tree import Tree

log = logging.getLogger(__name__)


def _libfuse3() -> None:
    """mfusepy loads its libfuse when first imported, by ``FUSE_LIBRARY_NAME`` (which ``import stfs`` sets to fuse3);
    one imported before stfs, the name unset, took libfuse2 where it is installed beside libfuse3 (Ubuntu desktops,
    for AppImages), whose structures stfs._native would write with libfuse3's offsets: such a module is run again
    now, loading libfuse3. A libfuse the environment names otherwise (``FUSE_LIBRARY_PATH``) is refused in one
    line."""
    global mfusepy
    chosen = os.environ.get("FUSE_LIBRARY_PATH") or os.environ.get("FUSE_LIBRARY_NAME", "fuse3") != "fuse3"
    if mfusepy.fuse_version_major != 3 and not chosen:
        log.debug("mfusepy had loaded %s (imported before stfs): loading libfuse3", mfusepy._libfuse_path)
        mfusepy = importlib.reload(mfusepy)
    if mfusepy.fuse_version_major != 3:
        raise errors.MountError(
            f"mfusepy loaded {mfusepy._libfuse_path} (libfuse {mfusepy.fuse_version_major}."
            f"{mfusepy.fuse_version_minor}), and stfs needs libfuse3: unset FUSE_LIBRARY_PATH, or set "
            "FUSE_LIBRARY_NAME=fuse3"
        )


_libfuse3()

from mfusepy import ENOATTR, FuseOSError, Operations  # noqa: E402

try:
    from . import _native  # type: ignore[attr-defined]  # noqa: E402
except ImportError as exc:  # built without a compiler or the libfuse3 headers: the Python path serves
    _native = None
    _NATIVE_MISSING = str(exc)


class StfsOperations(Protocol):
    """What this layer asks of ``fs.StfsOperations`` (the core every request goes through), by shape: the FUSE
    layer does not import the filesystem that uses it."""

    tree: Tree
    source: ByteSource
    served: bool
    readahead: Readahead
    failed_reads: FailedReads

    def node(self, path: str) -> Node: ...
    def file(self, path: str | None, fh: int) -> FileNode: ...
    def fill(self, node: FileNode, view: memoryview, offset: int) -> int: ...
    def failed(self, key: str, offset: int, exc: Exception) -> FuseOSError: ...
    def statfs(self, path: str) -> dict[str, int]: ...


NATIVE_VARIABLE = "STFS_NATIVE"  # "0": serve every request from Python
__all__ = ["ENOATTR", "NATIVE_VARIABLE", "FuseOSError", "Operations", "StfsFUSE", "request_size", "serve"]

FUSE_CAP_SPLICE_WRITE = 1 << 7  # fuse_common.h (tests/test_libfuse_layout.py checks it)
MAX_REQUEST = 1 << 20  # libfuse's (and the kernel's 256-page) limit on one read
_SPLICE_MIN = 2 * PAGE  # fuse_lowlevel.c fuse_send_data_iov: replies under two pages are copied, not spliced
_PIPE_SIZE = 2 << 20  # a 1 MiB read at an unaligned offset spans 257 pages: a pipe slot each
_RUNS = 64  # runs of a gathered tensor one reply takes at most (a 1 MiB read of 16 KiB rows); more are gathered
_SHORT_RUN = 64 << 10  # runs shorter than this on average are copied into the reply, not spliced
Piece = int | bytes | memoryview  # of a reply: bytes in this thread's pipe, or bytes to copy


class StfsFUSE(mfusepy.FUSE):
    """mfusepy's FUSE, with stfs._native in front of it where it is built."""

    def __init__(self, operations: StfsOperations, mountpoint: str, stats: Stats | None = None, **options: Any) -> None:
        self._max_read = int(options.get("max_read", 0))
        self._splice = False  # whether replies hold pipes: libfuse then splices them into /dev/fuse
        served = operations if stats is None else counted(operations, stats)
        native = native_start(operations, stats)
        if native is None:
            super().__init__(served, mountpoint, **options)  # serves until unmounted
            return
        reader = Reader(operations, stats)
        self._splice = reader.splice_into is not None
        real = mfusepy.fuse_main_real

        def main_real(argc: int, argv: Any, ops: Any, size: int, data: Any) -> int:
            native.install(ctypes.addressof(ops.contents), size)  # before libfuse copies the table
            return int(real(argc, argv, ops, size, data))

        native.reader(reader.answer)
        mfusepy.fuse_main_real = main_real
        try:
            super().__init__(served, mountpoint, **options)
        finally:
            mfusepy.fuse_main_real = real
            native.close()  # first: while the tables are installed, reader() refuses (and would hide why it ended)
            native.reader(None)

    def init_fuse_3(self, conn: Any, config: Any) -> None:
        stopping.watch(_session_exited())
        info = conn.contents
        info.max_read = self._max_read  # libfuse aborts unless it equals the max_read mount option
        if self._splice and info.capable & FUSE_CAP_SPLICE_WRITE:
            info.want |= FUSE_CAP_SPLICE_WRITE  # let libfuse splice the replies' pipes into /dev/fuse
        # else every reply is memory, which with splice-write on libfuse would first copy into a pipe of its own
        # (fuse_lowlevel.c, fuse_send_data_iov); off, it is written to /dev/fuse as is
        super().init_fuse_3(conn, config)

    def destroy(self, private_data: Any) -> None:
        stopping.watch(stopping.always)  # libfuse frees the session after this: never ask it again
        super().destroy(private_data)


def caller_pid() -> int:
    """The process whose request this libfuse thread serves (0 outside a request)."""
    try:
        return int(mfusepy.fuse_get_context()[2])
    except ValueError:  # no context (a NULL pointer): not a thread serving a request
        return 0


def _session_exited() -> Callable[[], bool]:
    """The check of the mark libfuse's SIGTERM/SIGINT handlers set on this mount's session (called in INIT, a
    thread of the session's, where ``fuse_get_context`` knows it)."""
    library = mfusepy._libfuse
    library.fuse_get_session.restype = ctypes.c_void_p
    library.fuse_get_session.argtypes = [ctypes.c_void_p]
    library.fuse_session_exited.restype = ctypes.c_int
    library.fuse_session_exited.argtypes = [ctypes.c_void_p]
    session = library.fuse_get_session(library.fuse_get_context().contents.fuse)
    exited = library.fuse_session_exited
    return lambda: bool(exited(session))


class Reader:
    """The reads stfs._native hands back: what each reply holds, as pieces C makes a ``fuse_bufvec`` of."""

    def __init__(self, operations: StfsOperations, stats: Stats | None) -> None:
        self.operations = operations
        self.stats = stats
        source = operations.source
        # A source that can splice lends its pages to the reply; any other is read into memory.
        self.splice_into = source.splice_into if isinstance(source, SpliceSource) else None
        self._read_source = source.read_into
        # By OS thread: C may give a libfuse thread a new Python thread state per call, so a thread-local would not do
        self._scratch: dict[int, memoryview] = {}
        self._lowered: dict[int, Lowered | None] = {}  # by inode: files of gathered tensors, as runs of sources

    def answer(self, path: bytes | None, fh: int, size: int, offset: int) -> list[Piece] | int:
        """The reply to a read: its pieces, or a negative errno (an unexpected failure is EIO and a log line)."""
        failed = self.operations.failed_reads
        file = fh or path
        if failed and failed.asked_again(file, offset):
            return -errno.EIO  # the kernel asking again for a read that just failed: one --timeout per read
        try:
            return self.pieces(path, fh, size, offset)
        except FuseOSError as exc:
            if exc.errno == errno.EIO:
                failed.add(file, offset, size)
            return -exc.errno
        except Exception:
            log.exception("read of %r at %d failed unexpectedly", path, offset)
            failed.add(file, offset, size)
            return -errno.EIO

    def pieces(self, path: bytes | None, fh: int, size: int, offset: int) -> list[Piece]:
        operations = self.operations
        node = operations.file(None if path is None else path.decode("utf-8", "surrogateescape"), fh)
        count = clamp(node, offset, size)
        stats = self.stats
        if stats is not None:
            stats.count_call("read_buf")
            stats.count_read(size, count)
        if count >= _SPLICE_MIN and self.splice_into is not None:
            segments = node.segments
            if len(segments) == 1 and type(segments[0]) is Range:  # a tensor or a whole file: one splice
                spliced = self._spliced([(segments[0], offset, count)])
            else:
                runs = self._runs(node, offset, count)
                if runs is not None and len(runs) * _SHORT_RUN > count:  # short runs: a pipe slot a page each
                    spliced = self._copied(runs, count)
                else:
                    spliced = self._spliced(runs if runs is not None else pieces(node, offset, count))
            if spliced is not None:
                return spliced
            if stats is not None:  # the pipe could not take the reply: copied instead
                stats.count_call("read_buf_copied")
        if not count:
            return []
        buffer = memoryview(bytearray(count))
        return [buffer[: operations.fill(node, buffer, offset)]]

    def _spliced(self, parts: list[Any]) -> list[Piece] | None:
        """``Range`` pieces spliced into this thread's pipe, ``Decoded`` ones decoded and lent to it, bytes as they
        are; ``None`` when the pipe fills up first (C empties it before its next use): the caller copies instead."""
        assert self.splice_into is not None
        pipe, limit = _native.pipe()
        reply: list[Piece] = []
        queued = 0
        lent = 0  # bytes of the scratch pages in use, whole pages per piece
        for segment, start, length in parts:
            if type(segment) is Range:
                queued += length
                if queued > limit:
                    return None
                try:
                    span = (segment.offset, segment.offset + segment.size)
                    moved = self.splice_into(segment.key, segment.offset + start, length, pipe, span)
                except FuseOSError:
                    raise
                except Exception as exc:
                    raise self.operations.failed(segment.key, segment.offset + start, exc) from exc
                if moved != length:
                    return None
                reply.append(length)
            elif type(segment) is Decoded or type(segment) is Gathered:
                queued += length
                scratch = self.scratch()
                if queued > limit or lent + length > len(scratch):
                    return None
                view = scratch[lent : lent + length]
                try:
                    segment.read_into(start, view, self._read_source)
                except Exception as exc:
                    raise self.operations.failed(segment.key, segment.offset, exc) from exc
                if _native.lend(view) != length:
                    return None
                reply.append(length)
                lent += -(-length // PAGE) * PAGE
            elif type(segment) is bytes:
                reply.append(memoryview(segment)[start : start + length])
            else:  # a Summary, made on its first read: copied by fill
                return None
        return reply

    def _copied(self, runs: list[tuple[Any, int, int]], count: int) -> list[Piece] | None:
        """Runs of sources (``Range`` pieces) and bytes copied into this thread's scratch pages, lent to its pipe.
        The runs of one source that follow one another there (a chunk's rows, each beside another chunk's in the
        reply) are read at once, then put in place."""
        _native.pipe()  # emptied
        scratch = self.scratch()
        if count > len(scratch):
            return None
        pending: dict[Range, list[tuple[int, int, int]]] = {}  # extent -> (start in it, length, where in the reply)
        done = 0
        for segment, start, length in runs:
            if type(segment) is bytes:
                scratch[done : done + length] = segment[start : start + length]
            else:
                waiting = pending.setdefault(segment, [])
                if waiting and waiting[-1][0] + waiting[-1][1] != start:
                    self._read_runs(segment, waiting, scratch)
                    waiting.clear()
                waiting.append((start, length, done))
            done += length
        for segment, waiting in pending.items():
            if waiting:
                self._read_runs(segment, waiting, scratch)
        return [count] if _native.lend(scratch[:count]) == count else None

    def _read_runs(self, extent: Range, runs: list[tuple[int, int, int]], scratch: memoryview) -> None:
        """Runs of ``extent`` that follow one another (``(start in it, length, where in scratch)``), read at once."""
        first, end = runs[0][0], runs[-1][0] + runs[-1][1]
        at, span = extent.offset + first, (extent.offset, extent.offset + extent.size)
        into = scratch[runs[0][2] : runs[0][2] + end - first] if len(runs) == 1 else memoryview(bytearray(end - first))
        try:
            got = self._read_source(extent.key, at, into, span)
        except Exception as exc:
            raise self.operations.failed(extent.key, at, exc) from exc
        if got != end - first:
            raise self.operations.failed(extent.key, at, OSError(f"{extent.key}: short read at byte {at}"))
        if len(runs) > 1:
            for start, length, where in runs:
                scratch[where : where + length] = into[start - first : start - first + length]

    def _runs(self, node: FileNode, offset: int, count: int) -> list[tuple[Any, int, int]] | None:
        """A read of a gathered tensor's file as runs of its sources, each spliced within its chunk (the span a remote
        source fetches and reads ahead in), where they are few: what C does, and C left to Python (a remote block not
        yet published). ``None``: gathered in memory instead."""
        if node.inode in self._lowered:
            lowered = self._lowered[node.inode]
        else:
            found = lower(node) if any(type(segment) is Gathered for segment in node.segments) else None
            lowered = self._lowered[node.inode] = Lowered(found) if isinstance(found, list) else None
        return lowered.runs(offset, count, _RUNS) if lowered is not None else None

    def scratch(self) -> memoryview:
        """This thread's page-aligned memory for decoded pieces, lent to the pipe.

        One reply at a time uses it: libfuse has copied a reply out of the pipe before the thread's next request.
        """
        thread = threading.get_native_id()
        scratch = self._scratch.get(thread)
        if scratch is None:
            scratch = self._scratch[thread] = memoryview(mmap.mmap(-1, MAX_REQUEST + 2 * PAGE))
        return scratch


def native_start(operations: StfsOperations, stats: Stats | None) -> Any:
    """``stfs._native`` with its tables built for ``operations`` (and its local sources' descriptors), or ``None``
    where the Python path serves (one log line saying why)."""
    if os.environ.get(NATIVE_VARIABLE, "1") == "0":
        log.info("requests are served from Python (%s=0)", NATIVE_VARIABLE)
        return None
    if _native is None:
        log.warning("stfs._native is not built (%s): requests are served from Python, slower", _NATIVE_MISSING)
        return None
    tree, source = operations.tree, operations.source
    descriptor = getattr(source, "descriptor", None)  # local files: C reads them from its own duplicates
    share_blocks = getattr(source, "share_blocks", None)  # remote files: C reads what their block cache holds
    gathered_by_python: list[tuple[FileNode, str]] = []

    def lowered(node: FileNode) -> list[Any] | None:
        try:
            found = lower(node)
        except Exception as exc:  # a layout that fails: that file is Python's, not the mount
            found = f"its layout failed: {exc!r}"
        if isinstance(found, str):
            gathered_by_python.append((node, found))
            return None
        return found

    try:
        keys, native_files, python_files = _native.build(
            tree.root,
            DirNode,
            FileNode,
            Range,
            tree.inode_limit,
            descriptor is not None or share_blocks is not None,
            ShardData,
            lowered,
        )
        _native.windows(tree.readahead_kb)
        if share_blocks is not None:
            _native.share_blocks(*share_blocks(Published(keys)))
        budget = getattr(source, "max_open", 0) // 2  # the duplicates must not take the sources' room
        held_sources = 0
        for index, key in enumerate(keys if len(keys) <= budget else []):
            held = descriptor(key) if descriptor is not None else None
            if held is not None:
                _native.set_source(index, *held)
                held_sources += 1
        statfs = operations.statfs("/")
        _native.configure(
            os.getuid(),
            os.getgid(),
            int(getattr(source, "drop_lag", 0)),
            (statfs["f_bsize"], statfs["f_frsize"], statfs["f_blocks"], statfs["f_files"], statfs["f_namemax"]),
            stats is not None,
        )
    except Exception as exc:  # a tree C cannot hold (a new kind of node, say): Python serves it all
        _native.close()
        log.warning("requests are served from Python: the C tables could not be built (%s)", exc)
        return None
    if gathered_by_python:  # once: C gathers every other tensor
        node, why = gathered_by_python[0]
        tensor = node.tensor.name if node.tensor is not None else f"inode {node.inode}"
        log.info(
            "%d gathered files are read by Python, not C, more slowly: the first, of tensor %r: %s",
            len(gathered_by_python),
            tensor,
            why,
        )
    operations.readahead.answer_in(_native)
    if stats is not None:
        stats.also_count(_native.counts)
    log.info(
        "requests answered in C: metadata, and reads of %d files from %d of %d sources (%d files read by Python)",
        native_files,
        len(keys) if share_blocks is not None else held_sources,
        len(keys),
        python_files,
    )
    return _native


class Published:
    """What a remote source publishes of its block cache, passed on to stfs._native (``sources.SharedBlocks``);
    sources are numbered as ``_native.build`` listed them. After the session every call does nothing."""

    def __init__(self, keys: list[str]) -> None:
        self._index = {key: index for index, key in enumerate(keys)}

    def publish(self, slot: int, key: str, block: int, lo: int, hi: int) -> None:
        index = self._index.get(key)
        if index is not None:  # else no file C reads is of it (a header, config.json read by Python)
            _native.publish(slot, index, block, lo, hi)

    def withdraw(self, slot: int) -> bool:
        return bool(_native.withdraw(slot))

    def changed(self, key: str) -> None:
        index = self._index.get(key)
        if index is not None:
            _native.changed(index)


def request_size() -> int:
    """The largest read request (at most libfuse's 1 MiB) whose reply fits a pipe this process can make.

    A 1 MiB reply spans 258 pipe slots; where pipes are capped at 1 MiB (256 slots:
    /proc/sys/fs/pipe-max-size without CAP_SYS_RESOURCE) requests are 1008 KiB instead.
    """
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    try:
        for size in (_PIPE_SIZE, _pipe_max_size()):
            try:
                fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, size)
                break
            except OSError:  # above /proc/sys/fs/pipe-max-size without CAP_SYS_RESOURCE
                continue
        # splice takes a slot per page touched; libfuse's own pipe needs three pages and the header more
        limit = fcntl.fcntl(write_fd, fcntl.F_GETPIPE_SZ) - 4 * PAGE
    finally:
        os.close(read_fd)
        os.close(write_fd)
    return max(128 << 10, min(MAX_REQUEST, limit // PAGE * PAGE))


def _pipe_max_size() -> int:
    try:
        with open("/proc/sys/fs/pipe-max-size") as stream:
            return int(stream.read())
    except (OSError, ValueError):
        return 1 << 20


def serve(operations: StfsOperations, mountpoint: str, foreground: bool = True, **options: Any) -> None:
    """Run the filesystem until unmounted or stopped by SIGTERM/SIGINT (blocks); ``STFS_STATS`` turns on counters."""
    stats = from_environment()
    if stats is not None:
        stats.dump_on_sigusr1()
    logged = _log_size()
    try:
        StfsFUSE(operations, mountpoint, stats=stats, foreground=foreground, **options)
    except RuntimeError as exc:
        # libfuse's loop reports the signal that stopped it as an error; after a served mount that is a clean stop
        if not operations.served:
            # what libfuse or fusermount3 printed, e.g. "fuse: unknown option(s): `-o bogus'"; on a terminal it is
            # there already
            said = _logged_since(logged) or f"{_MAIN_FAILURES.get(str(exc), exc)} (libfuse's reason is above)"
            raise errors.MountError(f"{mountpoint}: libfuse refused the mount: {said}") from None
        log.info("stopped by a signal (fuse_main returned %s); unmounted %s", exc, mountpoint)
    finally:
        if stats is not None:
            stats.dump()


# fuse_main_real's return values (libfuse's helper.c)
_MAIN_FAILURES = {
    "1": "invalid arguments",
    "2": "no mountpoint",
    "3": "it could not set up the session",
    "4": "mounting failed",
    "5": "it could not run in the background",
    "6": "it could not set up signal handlers",
}


_LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")  # stfs's own lines begin with their time


def _log_size() -> int | None:
    """How long the file stderr goes to is (a daemon's log), or ``None`` if it is not a file (a terminal)."""
    try:
        info = os.fstat(2)
    except OSError:
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def _logged_since(size: int | None) -> str:
    """The lines written to stderr's file past ``size`` but stfs's own log lines (libfuse's, fusermount3's), in one
    line."""
    if size is None:
        return ""
    try:
        with open("/proc/self/fd/2", "rb") as log_file:  # stderr itself is write-only
            log_file.seek(size)
            written = log_file.read(4096).decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip() for line in written.splitlines() if line.strip() and not _LOG_LINE.match(line)]
    return "; ".join(lines)[:500]
