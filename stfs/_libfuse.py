"""The C side of the FUSE layer: libfuse3 through mfusepy, packed structs, libc, pipes.

Everything here knows C layouts; nothing here knows what a tensor is. ``StfsFUSE`` replaces three of
mfusepy's callbacks with faster ones that pack their answers straight into C structs, asking
``StfsOperations``'s core (``node``, ``stat``, ``entries``, ``file``, ``fill``) for the content:

* ``read_buf``: the ``Range`` pieces of a read go into a pipe by ``splice`` (the kernel's one copy is into
  the mount's page cache), ``Decoded`` pieces are decoded into the thread's scratch pages and lent to the
  same pipe by ``vmsplice``; bytes held in memory, and everything of sources that cannot splice, go into a
  ``malloc``'d buffer. libfuse sends the ``fuse_bufvec`` and frees it (fuse.c,
  ``fuse_lib_read``/``fuse_free_buf``).
* ``getattr_fuse_3``: one ``struct stat`` packed by ``struct.pack`` instead of a ctypes field at a time.
* ``readdir_fuse_3``: entries with offsets, folders flagged READDIRPLUS with whole attributes.

In front of all of this, where it is built, sits ``stfs._native`` (stfs/_native.c): C functions installed in
the same operations table (``native_start``) answer getattr, readdir, open/release, statfs, and ``read_buf`` of
files that are one ``Range`` of a local source, from tables built once at mount (opendir, releasedir and flush
have no Python callback: libfuse answers them itself); they call the Python callbacks here for everything
else. ``STFS_NATIVE=0`` leaves them out.

``tests/test_libfuse_layout.py`` compiles a C program against the installed libfuse3 headers and checks
every size and offset used here. mfusepy private parts (``_wrapper``) are overridden: its major version
is pinned in pyproject.toml.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import struct
import termios
import threading
from collections.abc import Callable
from typing import Any, Protocol

os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")  # else mfusepy may load libfuse2 (128 KiB requests)

import mfusepy  # noqa: E402
from mfusepy import ENOATTR, FuseOSError, Operations  # noqa: E402

from .nodes import DIR_MODE, FILE_MODE, Decoded, DirNode, FileNode, Node, Range, clamp, pieces  # noqa: E402
from .sources import PAGE, ByteSource, SpliceSource  # noqa: E402
from .stats import Stats, from_environment  # noqa: E402
from .tree import Tree  # noqa: E402

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
    open_files: dict[int, FileNode]
    served: bool

    def node(self, path: str) -> Node: ...
    def stat(self, node: Node) -> tuple[int, ...]: ...
    def entries(self, path: str) -> list[tuple[str, Node]]: ...
    def file(self, path: str | None, fh: int) -> FileNode: ...
    def fill(self, node: FileNode, view: memoryview, offset: int) -> int: ...
    def failed(self, key: str, offset: int, exc: Exception) -> FuseOSError: ...
    def statfs(self, path: str) -> dict[str, int]: ...


NATIVE_VARIABLE = "STFS_NATIVE"  # "0": serve every request from Python
__all__ = [
    "ENOATTR",
    "NATIVE_VARIABLE",
    "STAT_FIELDS",
    "FuseOSError",
    "Operations",
    "StfsFUSE",
    "request_size",
    "serve",
]

log = logging.getLogger(__name__)

STAT_FIELDS = (
    "st_mode",
    "st_ino",
    "st_nlink",
    "st_size",
    "st_blocks",
    "st_blksize",
    "st_uid",
    "st_gid",
    "st_mtime",
    "st_ctime",
    "st_atime",
)
# fuse_common.h: FUSE_CAP_SPLICE_WRITE, FUSE_BUF_IS_FD; fuse.h: FUSE_FILL_DIR_PLUS.
FUSE_CAP_SPLICE_WRITE = 1 << 7
FUSE_BUF_IS_FD = 1 << 1
FUSE_FILL_DIR_PLUS = 1 << 1
# struct fuse_bufvec {size_t count, idx, off; struct fuse_buf buf[count];} and
# struct fuse_buf {size_t size; enum fuse_buf_flags flags; void *mem; int fd; off_t pos;}, native alignment.
BUFVEC_HEAD = struct.Struct("@NNN")
BUF = struct.Struct("@NiPiq")
_BUFVEC_SLACK = 64  # zeroed room past the fields libfuse 3.14 knows
MAX_REQUEST = 1 << 20  # libfuse's (and the kernel's 256-page) limit on one read
_SPLICE_MIN = 2 * PAGE  # fuse_lowlevel.c fuse_send_data_iov: replies under two pages are copied, not spliced
_PIPE_SIZE = 2 << 20  # a 1 MiB read at an unaligned offset spans 257 pages: a pipe slot each
_libc = ctypes.CDLL(None, use_errno=True)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.calloc.restype = ctypes.c_void_p
_libc.calloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]
_libc.vmsplice.restype = ctypes.c_ssize_t
_libc.vmsplice.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_uint]
_IOVEC = struct.Struct("@PN")  # struct iovec {void *iov_base; size_t iov_len;}
_POINTER = struct.Struct("@P")
_BUFVEC_POINTER = ctypes.POINTER(mfusepy.fuse_bufvec)
Buffer = tuple[int, int, int, int]  # one fuse_buf: (size, flags, mem, fd)


def _stat_layout() -> tuple[struct.Struct, list[int]]:
    """A ``struct`` for mfusepy's ``c_stat`` (this platform's struct stat) and where each STAT_FIELDS value goes."""
    slots: list[tuple[int, int, bool, str]] = []  # (offset, size, signed, field)
    for name in STAT_FIELDS:
        if name in ("st_mtime", "st_ctime", "st_atime"):
            spec = getattr(mfusepy.c_stat, name + "spec")
            seconds, nanoseconds = mfusepy.c_timespec.tv_sec, mfusepy.c_timespec.tv_nsec
            slots.append((spec.offset + seconds.offset, seconds.size, True, name + ":s"))
            slots.append((spec.offset + nanoseconds.offset, nanoseconds.size, True, name + ":ns"))
        else:
            field = getattr(mfusepy.c_stat, name)
            slots.append((field.offset, field.size, name in ("st_size", "st_blocks", "st_blksize"), name))
    slots.sort()
    fmt, position, order = "=", 0, []
    for offset, size, signed, name in slots:
        char = {2: "h", 4: "i", 8: "q"}[size]
        fmt += "x" * (offset - position) + (char if signed else char.upper())
        position = offset + size
        order.append(name)
    fmt += "x" * (ctypes.sizeof(mfusepy.c_stat) - position)
    return struct.Struct(fmt), [STAT_FIELDS.index(name.split(":")[0]) * 2 + name.endswith(":ns") for name in order]


STAT, _STAT_ORDER = _stat_layout()


def pack_stat(values: tuple[int, ...]) -> bytes:
    """The bytes of a struct stat holding ``values`` (in STAT_FIELDS order; times in nanoseconds)."""
    expanded: list[int] = []
    for index, value in enumerate(values):
        if index >= 8:  # the three times: seconds, nanoseconds
            expanded += divmod(value, 1_000_000_000)
        else:
            expanded += (value, 0)
    return STAT.pack(*[expanded[position] for position in _STAT_ORDER])


def _pipe_max_size() -> int:
    try:
        with open("/proc/sys/fs/pipe-max-size") as stream:
            return int(stream.read())
    except (OSError, ValueError):
        return 1 << 20


class _Pipe:
    """One thread's pipe for splicing source pages to libfuse."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        for size in (_PIPE_SIZE, _pipe_max_size()):
            try:
                fcntl.fcntl(self.write_fd, fcntl.F_SETPIPE_SZ, size)
                break
            except OSError:  # above /proc/sys/fs/pipe-max-size without CAP_SYS_RESOURCE
                continue
        capacity = fcntl.fcntl(self.write_fd, fcntl.F_GETPIPE_SZ)
        # Splice takes a slot per page touched (count / 4096 + 2 when unaligned); libfuse's own pipe,
        # under the same limits, needs three pages and the header more than the count.
        self.limit = capacity - 4 * PAGE
        self._scratch: mmap.mmap | None = None
        self._iovec = ctypes.create_string_buffer(_IOVEC.size)

    def scratch(self) -> tuple[memoryview, int]:
        """Page-aligned memory for decoded pieces, lent to the pipe (``lend``), and its address.

        One reply at a time uses it: libfuse has copied a reply out of the pipe before the thread's next
        request, and a pipe left holding a reply is drained first (``_splice_pieces``).
        """
        if self._scratch is None:
            self._scratch = mmap.mmap(-1, MAX_REQUEST + 2 * PAGE)
            self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._scratch))
            self._view = memoryview(self._scratch)
        return self._view, self._address

    def lend(self, address: int, count: int) -> int:
        """``vmsplice`` ``count`` bytes at ``address`` into the pipe by reference; the count moved (-1: full)."""
        _IOVEC.pack_into(self._iovec, 0, address, count)
        return int(_libc.vmsplice(self.write_fd, ctypes.addressof(self._iovec), 1, 0))

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)

    def is_empty(self) -> bool:
        return struct.unpack("i", fcntl.ioctl(self.read_fd, termios.FIONREAD, b"\0\0\0\0"))[0] == 0

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 1 << 20):
                pass
        except BlockingIOError:
            pass


def _malloc(size: int) -> int:
    memory = _libc.malloc(size or 1)
    if not memory:
        raise FuseOSError(errno.ENOMEM)
    return int(memory)


_ONE_BUFFER = struct.Struct(BUFVEC_HEAD.format + BUF.format[1:])  # a vector of one buffer, the usual reply
_ONE_BUFFER_SIZE = _ONE_BUFFER.size + _BUFVEC_SLACK
_ONE_BUFFER_MEMORY = ctypes.c_char * _ONE_BUFFER_SIZE


def _reply_one(bufpp: Any, count: int, flags: int, memory: int, fd: int) -> int:
    """Hand libfuse a malloc'd ``fuse_bufvec`` of one buffer (the hot path: one pack, no lists)."""
    bufvec = _libc.calloc(1, _ONE_BUFFER_SIZE)
    if not bufvec:
        if not flags & FUSE_BUF_IS_FD:
            _libc.free(memory)
        raise FuseOSError(errno.ENOMEM)
    # pack_into and a pointer made from bytes: fewer foreign calls than ctypes.memmove
    _ONE_BUFFER.pack_into(_ONE_BUFFER_MEMORY.from_address(bufvec), 0, 1, 0, 0, count, flags, memory, fd, 0)
    bufpp[0] = _BUFVEC_POINTER.from_buffer_copy(_POINTER.pack(bufvec))
    return 0


def _memory_view(memory: int, size: int) -> memoryview:
    """The ``size`` bytes at address ``memory`` (malloc'd), writable."""
    return memoryview((ctypes.c_char * size).from_address(memory)).cast("B")


def _reply(bufpp: Any, buffers: list[Buffer]) -> int:
    """Hand libfuse a malloc'd ``fuse_bufvec`` of ``buffers``; it frees the vector and every memory buffer."""
    if len(buffers) == 1:
        return _reply_one(bufpp, *buffers[0])
    size = BUFVEC_HEAD.size + BUF.size * len(buffers) + _BUFVEC_SLACK
    bufvec = _libc.calloc(1, size)
    if not bufvec:
        for _, flags, memory, _ in buffers:
            if not flags & FUSE_BUF_IS_FD:
                _libc.free(memory)
        raise FuseOSError(errno.ENOMEM)
    target = (ctypes.c_char * size).from_address(bufvec)
    BUFVEC_HEAD.pack_into(target, 0, len(buffers), 0, 0)
    for index, (count, flags, memory, fd) in enumerate(buffers):
        BUF.pack_into(target, BUFVEC_HEAD.size + index * BUF.size, count, flags, memory, fd, 0)
    bufpp[0] = _BUFVEC_POINTER.from_buffer_copy(_POINTER.pack(bufvec))
    return 0


class StfsFUSE(mfusepy.FUSE):
    """mfusepy's FUSE with replies packed in C: ``read_buf`` (splice or one copy), stat and readdirplus."""

    def __init__(self, operations: StfsOperations, mountpoint: str, stats: Stats | None = None, **options: Any) -> None:
        self.stats = stats
        # By OS thread: a thread-local would not do, ctypes may give a libfuse thread a new Python thread state
        # per callback (a remote mount's blocking reads showed a new pipe per request, never closed).
        self._pipes: dict[int, _Pipe] = {}
        self._max_read = int(options.get("max_read", 0))
        self._listing: tuple[str, list[tuple[bytes, DirNode | FileNode]]] | None = None
        self._folder_entry = mfusepy.c_stat(st_mode=DIR_MODE, st_nlink=2)
        self._file_entry = mfusepy.c_stat(st_mode=FILE_MODE, st_nlink=1)
        source = operations.source
        # A source that can splice (local files) lends its pages to the reply; any other is read into memory.
        self._splice_into = source.splice_into if isinstance(source, SpliceSource) else None
        self._read_source = source.read_into
        native = native_start(operations, stats)
        if native is None:
            super().__init__(operations, mountpoint, **options)  # serves until unmounted
            return
        real = mfusepy.fuse_main_real

        def main_real(argc: int, argv: Any, ops: Any, size: int, data: Any) -> int:
            native.install(ctypes.addressof(ops.contents), size)  # before libfuse copies the table
            return int(real(argc, argv, ops, size, data))

        mfusepy.fuse_main_real = main_real
        try:
            super().__init__(operations, mountpoint, **options)
        finally:
            mfusepy.fuse_main_real = real
            native.close()

    def _wrapper(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
        """Call a callback; an errno it raises goes back to the kernel, anything unexpected as EIO with a log line.

        (mfusepy's own wrapper answers a stray exception with EINVAL, and an ``OSError`` of a source,
        such as ENOENT of a deleted file, with its own errno, which would mean something else here.)
        """
        if self.stats is not None:
            self.stats.count_call(func.__name__)
        try:
            return func(*args, **kwargs) or 0
        except FuseOSError as exc:
            return -exc.errno
        except Exception:
            if func.__name__ in ("init", "init_fuse_3"):
                raise
            log.exception("%s failed unexpectedly", func.__name__)
            return -errno.EIO
        except BaseException as exc:  # SystemExit and the like: stop the loop, as mfusepy does, and re-raise after it
            self._FUSE__critical_exception = exc
            log.critical("%s raised %r; stopping", func.__name__, exc)
            mfusepy.fuse_exit()
            return -errno.EFAULT

    def init_fuse_3(self, conn: Any, config: Any) -> None:
        info = conn.contents
        info.max_read = self._max_read  # libfuse aborts unless it equals the max_read mount option
        if self._splice_into is not None and info.capable & FUSE_CAP_SPLICE_WRITE:
            info.want |= FUSE_CAP_SPLICE_WRITE  # let libfuse splice read_buf's pipes into /dev/fuse
        # else (a remote source): every reply is memory, which with splice-write on libfuse would first copy
        # into a pipe of its own (fuse_lowlevel.c, fuse_send_data_iov); off, it is written to /dev/fuse as is
        super().init_fuse_3(conn, config)

    def getattr_fuse_3(self, path: bytes | None, buf: Any, fip: Any) -> int:
        operations = self.operations
        if path is None:
            node: DirNode | FileNode = operations.file(None, fip.contents.fh)
        else:
            node = operations.node(path.decode(self.encoding, self.errors))
        ctypes.memmove(buf, pack_stat(operations.stat(node)), STAT.size)
        return 0

    def readdir_fuse_3(self, path: bytes | None, buf: Any, filler: Any, offset: int, fip: Any, flags: int) -> int:
        # Entries carry offsets (the index + 1), so libfuse passes each straight to the kernel rather than
        # collecting the whole listing first, and a folder's entry, flagged "plus", is looked up at once
        # (libfuse calls getattr in-process): READDIRPLUS hands the kernel the folder's dentry and
        # attributes, and walking into it (find, ls -R) costs no LOOKUP request. A file's entry needs
        # only its type and inode (mfusepy's notes on readdir). The listing of the last folder is kept:
        # the kernel asks for a long one a few KiB at a time.
        decoded = "/" if path is None else path.decode(self.encoding, self.errors)
        listing = self._listing
        if listing is None or listing[0] != decoded:
            encoding, errors = self.encoding, self.errors
            entries = [(name.encode(encoding, errors), node) for name, node in self.operations.entries(decoded)]
            listing = self._listing = (decoded, entries)
        entries = listing[1]
        folder, file = self._folder_entry, self._file_entry
        stat = self.operations.stat
        for index in range(offset, len(entries)):
            name, child = entries[index]
            if type(child) is not DirNode:
                file.st_ino = child.inode
                full = filler(buf, name, file, index + 1, 0)
            elif index > 1:  # the kernel keeps these attributes for attr_timeout: all of them, then
                ctypes.memmove(ctypes.addressof(folder), pack_stat(stat(child)), STAT.size)
                full = filler(buf, name, folder, index + 1, FUSE_FILL_DIR_PLUS)
            else:  # "." and "..": never looked up
                folder.st_mode, folder.st_ino = DIR_MODE, child.inode
                full = filler(buf, name, folder, index + 1, 0)
            if full:
                break
        return 0

    def read_buf(self, path: bytes | None, bufpp: Any, size: int, offset: int, fip: Any) -> int:
        # The hot path (one call per request): no decorated calls, no Python objects it can avoid.
        operations = self.operations
        fh = fip.contents.fh
        node = operations.open_files.get(fh)
        if node is None:
            node = operations.file(None if path is None else path.decode(self.encoding, self.errors), fh)
        count = clamp(node, offset, size)
        if self.stats is not None:
            self.stats.count_read(size, count)
        if count >= _SPLICE_MIN and self._splice_into is not None:
            segments = node.segments
            if len(segments) == 1 and type(segments[0]) is Range:  # a tensor or a whole file: one splice
                buffers = self._splice_pieces([(segments[0], offset, count)], operations)
            else:
                buffers = self._splice_pieces(pieces(node, offset, count), operations)
            if buffers is not None:
                return _reply(bufpp, buffers)
            if self.stats is not None:  # the pipe could not take the reply: copied instead
                self.stats.count_call("read_buf_copied")
        memory = _libc.malloc(count or 1)
        if not memory:
            raise FuseOSError(errno.ENOMEM)
        try:
            if count:
                count = operations.fill(
                    node, memoryview((ctypes.c_char * count).from_address(memory)).cast("B"), offset
                )
        except BaseException:
            _libc.free(memory)
            raise
        return _reply_one(bufpp, count, 0, memory, -1)

    def _splice_pieces(self, parts: list[Any], operations: StfsOperations) -> list[Buffer] | None:
        """The reply's buffers: ``Range`` pieces spliced into this thread's pipe, bytes and ``Decoded`` pieces in
        malloc'd memory.

        ``None`` (pipe emptied, nothing allocated) when the pipe fills up first: the caller copies instead.
        """
        assert self._splice_into is not None
        pipe = self._pipe()
        if not pipe.is_empty():  # left over from a reply libfuse gave up on
            pipe.drain()
        buffers: list[Buffer] = []
        spliced = 0
        lent = 0  # bytes of the scratch pages in use, whole pages per piece
        try:
            for segment, start, length in parts:
                if type(segment) is Range:
                    spliced += length
                    if spliced > pipe.limit:
                        break
                    try:
                        span = (segment.offset, segment.offset + segment.size)
                        moved = self._splice_into(segment.key, segment.offset + start, length, pipe.write_fd, span)
                    except FuseOSError:
                        raise
                    except Exception as exc:
                        raise operations.failed(segment.key, segment.offset + start, exc) from exc
                    if moved != length:
                        break
                    buffers.append((length, FUSE_BUF_IS_FD, 0, pipe.read_fd))
                elif type(segment) is Decoded:
                    spliced += length
                    scratch, address = pipe.scratch()
                    if spliced > pipe.limit or lent + length > len(scratch):
                        break
                    try:
                        segment.read_into(start, scratch[lent : lent + length], self._read_source)
                    except Exception as exc:
                        raise operations.failed(segment.key, segment.offset, exc) from exc
                    if pipe.lend(address + lent, length) != length:
                        break
                    buffers.append((length, FUSE_BUF_IS_FD, 0, pipe.read_fd))
                    lent += -(-length // PAGE) * PAGE
                elif type(segment) is not bytes:  # a Summary, made on its first read: copied by fill
                    break
                else:
                    memory = _malloc(length)
                    ctypes.memmove(memory, segment[start : start + length], length)
                    buffers.append((length, 0, memory, -1))
            else:
                return buffers
        except BaseException:
            self._discard(buffers, pipe)
            raise
        self._discard(buffers, pipe)
        return None

    @staticmethod
    def _discard(buffers: list[Buffer], pipe: _Pipe) -> None:
        for _, flags, memory, _ in buffers:
            if not flags & FUSE_BUF_IS_FD:
                _libc.free(memory)
        pipe.drain()

    def _pipe(self) -> _Pipe:
        thread = threading.get_native_id()
        pipe = self._pipes.get(thread)
        if pipe is None:
            pipe = self._pipes[thread] = _Pipe()
        return pipe


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
    try:
        keys, native_files, python_files = _native.build(
            tree.root, DirNode, FileNode, Range, tree.inode_limit, descriptor is not None
        )
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
    if stats is not None:
        stats.also_count(_native.counts)
    log.info(
        "requests answered in C: metadata, and reads of %d files from %d of %d sources (%d files read by Python)",
        native_files,
        held_sources,
        len(keys),
        python_files,
    )
    return _native


def request_size() -> int:
    """The largest read request (at most libfuse's 1 MiB) whose reply fits a pipe this process can make.

    A 1 MiB reply spans 258 pipe slots; where pipes are capped at 1 MiB (256 slots:
    /proc/sys/fs/pipe-max-size without CAP_SYS_RESOURCE) requests are 1008 KiB instead.
    """
    pipe = _Pipe()
    try:
        return max(128 << 10, min(MAX_REQUEST, pipe.limit // PAGE * PAGE))
    finally:
        pipe.close()


def serve(operations: StfsOperations, mountpoint: str, foreground: bool = True, **options: Any) -> None:
    """Run the filesystem until unmounted or stopped by SIGTERM/SIGINT (blocks); ``STFS_STATS`` turns on counters."""
    stats = from_environment()
    if stats is not None:
        stats.dump_on_sigusr1()
    try:
        StfsFUSE(operations, mountpoint, stats=stats, foreground=foreground, **options)
    except RuntimeError as exc:
        # libfuse's loop reports the signal that stopped it as an error; after a served mount that is a clean stop
        if not operations.served:
            raise RuntimeError(f"libfuse could not mount {mountpoint} (error {exc})") from None
        log.info("stopped by signal %s; unmounted %s", exc, mountpoint)
    finally:
        if stats is not None:
            stats.dump()
