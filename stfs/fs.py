"""The FUSE layer: path -> node -> answer. errno lives here and only here."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import struct
import termios
import threading
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")  # else mfusepy may load libfuse2 (128 KiB requests)

import mfusepy  # noqa: E402
from mfusepy import FuseOSError, Operations  # noqa: E402

from .source import ByteSource  # noqa: E402
from .stats import Stats, from_environment  # noqa: E402
from .tree import DIR_MODE, FILE_MODE, DirNode, FileNode, Node, Tree, file_mode

log = logging.getLogger(__name__)

BLOCK_SIZE = 4096
DAEMON_PID_XATTR = "user.stfs.pid"
STAT_FIELDS = ("st_mode", "st_ino", "st_nlink", "st_size", "st_blocks", "st_blksize", "st_uid", "st_gid",
               "st_mtime", "st_ctime", "st_atime")
F = TypeVar("F", bound=Callable[..., Any])


def _eio_on_surprise(method: F) -> F:
    """Turn an unexpected exception into EIO and a log line, not mfusepy's default EINVAL."""

    @wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except FuseOSError:
            raise
        except OSError as exc:
            log.error("%s%r failed: %s", method.__name__, args[1:3], exc)
            raise FuseOSError(errno.EIO) from exc
        except Exception as exc:
            log.exception("%s%r failed unexpectedly", method.__name__, args[1:3])
            raise FuseOSError(errno.EIO) from exc

    return wrapper  # type: ignore[return-value]


def _read_only(*_: Any, **__: Any) -> int:
    raise FuseOSError(errno.EROFS)


class StfsOperations(Operations):
    """A read-only view of a built ``Tree``; bytes come from a ``ByteSource``."""

    use_ns = True

    def __init__(self, tree: Tree, source: ByteSource, on_ready: Callable[[], None] | None = None) -> None:
        self.tree = tree
        self.source = source
        self._on_ready = on_ready
        self._uid = os.getuid()
        self._gid = os.getgid()
        self.open_files: dict[int, FileNode] = {}  # by file handle: the tensor's inode
        self.served = False  # set once the kernel has connected

    def _lookup(self, path: str) -> Node:
        node = self.tree.lookup(path)
        if node is None:
            raise FuseOSError(errno.ENOENT)
        return node

    def init(self, path: str) -> None:
        self.served = True
        if self._on_ready is not None:
            self._on_ready()

    def destroy(self, path: str) -> None:
        self.source.close()

    @_eio_on_surprise
    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        return dict(zip(STAT_FIELDS, self.stat(self._lookup(path)), strict=True))

    def stat(self, node: Node) -> tuple[int, ...]:
        """The values of ``STAT_FIELDS`` for ``node`` (``StfsFUSE`` packs them straight into a struct stat)."""
        if isinstance(node, DirNode):
            return (DIR_MODE, node.inode, 2, 0, 0, BLOCK_SIZE, self._uid, self._gid,
                    node.mtime_ns, node.mtime_ns, node.mtime_ns)
        size = node.size
        # st_blocks counts 512-byte units whatever the block size
        return (FILE_MODE, node.inode, 1, size, (size + 511) // 512, BLOCK_SIZE, self._uid, self._gid,
                node.mtime_ns, node.mtime_ns, node.mtime_ns)

    @_eio_on_surprise
    def node(self, path: str) -> Node:
        """The node at ``path``; ``ENOENT`` if there is none."""
        return self._lookup(path)

    @_eio_on_surprise
    def directory(self, path: str) -> DirNode:
        """The folder at ``path``; ``ENOENT`` or ``ENOTDIR`` otherwise."""
        node = self._lookup(path)
        if not isinstance(node, DirNode):
            raise FuseOSError(errno.ENOTDIR)
        return node

    @_eio_on_surprise
    def readdir(self, path: str, fh: int) -> list[Any]:
        node = self.directory(path)
        parent = node.parent
        # use_ino: an entry with inode 0 is skipped by readdir(3), so "." and ".." carry theirs
        entries: list[Any] = [
            (".", {"st_mode": file_mode(node), "st_ino": node.inode}, 0),
            ("..", {"st_mode": file_mode(parent), "st_ino": parent.inode}, 0),
        ]
        entries.extend((name, {"st_mode": file_mode(child), "st_ino": child.inode}, 0)
                       for name, child in node.children.items())
        return entries

    @_eio_on_surprise
    def open(self, path: str, flags: int) -> int:
        node = self._lookup(path)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND):
            raise FuseOSError(errno.EROFS)
        if isinstance(node, DirNode):
            raise FuseOSError(errno.EISDIR)
        self.open_files[node.inode] = node
        return node.inode

    def _file(self, path: str | None, fh: int) -> FileNode:
        node = self.open_files.get(fh)
        if node is None and path is not None:
            found = self._lookup(path)
            if isinstance(found, DirNode):
                raise FuseOSError(errno.EISDIR)
            node = found
        if node is None:
            raise FuseOSError(errno.EBADF)
        return node

    @_eio_on_surprise
    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        buffer = bytearray(max(0, min(size, self._file(path, fh).size - offset)))
        count = self.read_into(path, memoryview(buffer), offset, fh)
        return bytes(buffer[:count])

    @_eio_on_surprise
    def read_buf(self, path: str | None, size: int, offset: int, fh: int) -> tuple[FileNode, int]:
        """The file a read of ``size`` bytes at ``offset`` reads, and the count, clamped at the file's end.

        Named like the libfuse callback so that mfusepy registers it; ``StfsFUSE.read_buf`` does the C side.
        """
        node = self._file(path, fh)
        return node, max(0, min(size, node.size - offset))

    @_eio_on_surprise
    def read_into(self, path: str | None, buffer: memoryview, offset: int, fh: int) -> int:
        """Fill ``buffer`` from ``offset`` of the file; the read is clamped at the file's end."""
        node = self._file(path, fh)
        count = max(0, min(len(buffer), node.size - offset))
        return self.fill(node, buffer, offset, count) if count else 0

    def fill(self, node: FileNode, buffer: Any, offset: int, count: int) -> int:
        """Copy ``count`` bytes of ``node`` from ``offset`` (clamped already) to the start of ``buffer``."""
        if node.data is not None:
            buffer[:count] = node.data[offset : offset + count]
            return count
        assert node.file is not None
        view = buffer if len(buffer) == count else memoryview(buffer)[:count]
        return self.source.read_into(node.file, node.offset + offset, view)

    @_eio_on_surprise
    def statfs(self, path: str) -> dict[str, int]:
        blocks = (self.tree.data_size + BLOCK_SIZE - 1) // BLOCK_SIZE
        return {
            "f_bsize": BLOCK_SIZE,
            "f_frsize": BLOCK_SIZE,
            "f_blocks": blocks,
            "f_bfree": 0,
            "f_bavail": 0,
            "f_files": self.tree.file_count,
            "f_ffree": 0,
            "f_favail": 0,
            "f_namemax": 255,
        }

    @_eio_on_surprise
    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
        xattrs = self._xattrs(path)
        if name not in xattrs:
            raise FuseOSError(mfusepy.ENOATTR)
        return xattrs[name]

    @_eio_on_surprise
    def listxattr(self, path: str) -> list[str]:
        return list(self._xattrs(path))

    def _xattrs(self, path: str) -> dict[str, bytes]:
        node = self._lookup(path)
        if isinstance(node, FileNode):
            return node.xattrs
        if node is self.tree.root:  # which process serves this mount: for `kill`, monitoring and tests
            return {DAEMON_PID_XATTR: str(os.getpid()).encode()}
        return {}

    @_eio_on_surprise
    def access(self, path: str, amode: int) -> int:
        self._lookup(path)
        if amode & os.W_OK:
            raise FuseOSError(errno.EROFS)
        return 0

    @_eio_on_surprise
    def release(self, path: str, fh: int) -> int:
        return 0

    # Every mutating call: the mount is read-only (SPEC §3).
    chmod = chown = create = link = mkdir = mknod = rename = rmdir = _read_only
    setxattr = removexattr = symlink = truncate = unlink = utimens = write = _read_only


FUSE_CAP_SPLICE_WRITE = 1 << 7
FUSE_BUF_IS_FD = 1 << 1
FUSE_FILL_DIR_PLUS = 1 << 1
# struct fuse_bufvec {size_t count, idx, off; struct fuse_buf {size_t size; enum flags; void *mem; int fd;
# off_t pos;} buf[1];}, native alignment; libfuse frees it (and a memory buffer's mem) with free().
_BUFVEC = struct.Struct("@NNNNiPiq")
_BUFVEC_ALLOCATION = 128  # zeroed room past the fields libfuse 3.14 knows
MAX_REQUEST = 1 << 20  # libfuse's (and the kernel's 256-page) limit on one read
_SPLICE_MIN = 2 * 4096  # libfuse copies replies under two pages rather than splice them
_PIPE_SIZE = 2 << 20  # a 1 MiB read at an unaligned offset spans 257 pages: a pipe slot each
_libc = ctypes.CDLL(None, use_errno=True)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.calloc.restype = ctypes.c_void_p
_libc.calloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]
_POINTER = struct.Struct("@P")
_BUFVEC_MEMORY = ctypes.c_char * _BUFVEC_ALLOCATION
_BUFVEC_POINTER = ctypes.POINTER(mfusepy.fuse_bufvec)


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


_STAT, _STAT_ORDER = _stat_layout()


def _pack_stat(values: tuple[int, ...]) -> bytes:
    """The bytes of a struct stat holding ``values`` (in STAT_FIELDS order; times in nanoseconds)."""
    expanded: list[int] = []
    for index, value in enumerate(values):
        if index >= 8:  # the three times: seconds, nanoseconds
            expanded += divmod(value, 1_000_000_000)
        else:
            expanded += (value, 0)
    return _STAT.pack(*[expanded[position] for position in _STAT_ORDER])




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
        self.limit = capacity - 4 * 4096

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


class StfsFUSE(mfusepy.FUSE):
    """mfusepy's FUSE with a ``read_buf`` callback: pages spliced from the source, else one copy into memory.

    libfuse calls ``read_buf`` instead of ``read`` when both exist. Large reads go through a pipe
    (``splice``: the kernel's one copy is into the mount's page cache); small ones, memory blobs and
    sources that cannot splice are read into a ``malloc``'d buffer that libfuse writes and frees.
    """

    def __init__(self, operations: StfsOperations, mountpoint: str, stats: Stats | None = None, **options: Any) -> None:
        self.stats = stats
        self._local = threading.local()
        self._failed_sources: set[str | None] = set()
        self._max_read = int(options.get("max_read", 0))
        self._listing: tuple[str, list[tuple[bytes, Node]]] | None = None
        self._folder_entry = mfusepy.c_stat(st_mode=DIR_MODE, st_nlink=2)
        self._file_entry = mfusepy.c_stat(st_mode=FILE_MODE, st_nlink=1)
        self.source = operations.source
        # A source that can splice (LocalFiles) lends its pages to the reply; any other is read into memory.
        self._splice_into: Callable[[str, int, int, int], int] | None = getattr(self.source, "splice_into", None)
        if stats is not None:  # mfusepy wraps every callback in self._wrapper: count there, only when asked
            self._wrapper = self._counting_wrapper
        super().__init__(operations, mountpoint, **options)  # serves until unmounted

    def _counting_wrapper(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        assert self.stats is not None
        self.stats.count_call(func.__name__)
        return super()._wrapper(func, *args, **kwargs)

    def init_fuse_3(self, conn: Any, config: Any) -> None:
        info = conn.contents
        info.max_read = self._max_read  # libfuse aborts unless it equals the max_read mount option
        if info.capable & FUSE_CAP_SPLICE_WRITE:
            info.want |= FUSE_CAP_SPLICE_WRITE  # let libfuse splice read_buf's pipes into /dev/fuse
        super().init_fuse_3(conn, config)

    def getattr_fuse_3(self, path: bytes | None, buf: Any, fip: Any) -> int:
        operations = self.operations
        if path is None:
            node: Node = operations._file(None, fip.contents.fh)
        else:
            node = operations.node(path.decode(self.encoding, self.errors))
        ctypes.memmove(buf, _pack_stat(operations.stat(node)), _STAT.size)
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
            node = self.operations.directory(decoded)
            encoding, errors = self.encoding, self.errors
            entries = [(b".", node), (b"..", node.parent)]
            entries += [(name.encode(encoding, errors), child) for name, child in node.children.items()]
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
                ctypes.memmove(ctypes.addressof(folder), _pack_stat(stat(child)), _STAT.size)
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
            node, _ = operations.read_buf(None if path is None else path.decode(self.encoding, self.errors),
                                          size, offset, fh)
        count = min(size, node.size - offset)
        if count < 0:
            count = 0
        if self.stats is not None:
            self.stats.count_read(size, count)
        file = node.file
        try:
            if file is not None and count >= _SPLICE_MIN and self._splice_into is not None:
                pipe = self._pipe()
                if count <= pipe.limit and self._splice(file, node.offset + offset, count, pipe):
                    return self._reply(bufpp, count, FUSE_BUF_IS_FD, 0, pipe.read_fd)
            memory = _libc.malloc(count or 1)
            if not memory:
                raise FuseOSError(errno.ENOMEM)
            try:
                if count:
                    count = operations.fill(node, (ctypes.c_char * count).from_address(memory), offset, count)
            except BaseException:
                _libc.free(memory)
                raise
            return self._reply(bufpp, count, 0, memory, -1)
        except OSError as exc:
            if isinstance(exc, FuseOSError):
                raise
            # One line per source, not per read: a truncated source under a busy reader would fill the log.
            level = logging.DEBUG if file in self._failed_sources else logging.ERROR
            self._failed_sources.add(file)
            log.log(level, "read of %s at %d failed: %s (further failures of it are logged at debug level)",
                    file, offset, exc)
            raise FuseOSError(errno.EIO) from exc

    def _splice(self, file: str, offset: int, count: int, pipe: _Pipe) -> bool:
        """Splice ``count`` bytes into ``pipe``; False (pipe emptied) if it filled up first."""
        if not pipe.is_empty():  # left over from a reply libfuse gave up on
            pipe.drain()
        try:
            assert self._splice_into is not None
            if self._splice_into(file, offset, count, pipe.write_fd) == count:
                return True
        except BaseException:
            pipe.drain()
            raise
        pipe.drain()
        return False

    @staticmethod
    def _reply(bufpp: Any, count: int, flags: int, memory: int, fd: int) -> int:
        bufvec = _libc.calloc(1, _BUFVEC_ALLOCATION)
        if not bufvec:
            if memory:
                _libc.free(memory)
            raise FuseOSError(errno.ENOMEM)
        # pack_into and a pointer made from bytes: fewer foreign calls than two ctypes.memmove
        _BUFVEC.pack_into(_BUFVEC_MEMORY.from_address(bufvec), 0, 1, 0, 0, count, flags, memory, fd, 0)
        bufpp[0] = _BUFVEC_POINTER.from_buffer_copy(_POINTER.pack(bufvec))
        return 0

    def _pipe(self) -> _Pipe:
        pipe: _Pipe | None = getattr(self._local, "pipe", None)
        if pipe is None:
            pipe = self._local.pipe = _Pipe()
        return pipe


def request_size() -> int:
    """The largest read request (at most libfuse's 1 MiB) whose reply fits a pipe this process can make.

    A 1 MiB reply spans 258 pipe slots; where pipes are capped at 1 MiB (256 slots:
    /proc/sys/fs/pipe-max-size without CAP_SYS_RESOURCE) requests are 1008 KiB instead.
    """
    pipe = _Pipe()
    try:
        return max(128 << 10, min(MAX_REQUEST, pipe.limit // 4096 * 4096))
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

