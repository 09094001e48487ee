"""The FUSE layer: path -> node -> answer. errno lives here and only here.

``StfsOperations`` answers every request through a small core — ``node``, ``stat``, ``entries``,
``file``, ``fill`` — that mfusepy's plain callbacks (``getattr``, ``readdir``, ``read``, ...) wrap,
and that ``_libfuse.Reader`` calls for the reads stfs._native hands back: one request path. Any
failure that is not already an errno becomes ``EIO`` with a log line.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

from ._libfuse import ENOATTR, FuseOSError, Operations, caller_pid
from .failed_reads import FailedReads
from .nodes import DIR_MODE, FILE_MODE, DirNode, FileNode, Node, clamp, file_mode, read_into, tensor_xattrs
from .readahead import Readahead
from .sources import PAGE, ByteSource, SourceChanged
from .tree import NAME_MAX, Tree

log = logging.getLogger(__name__)

DAEMON_PID_XATTR = "user.stfs.pid"
CHANGED_XATTR = "user.stfs.changed"
F = TypeVar("F", bound=Callable[..., Any])
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


def eio_on_surprise(method: F) -> F:
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
    """A read-only view of a built ``Tree``; the bytes of ``Range`` segments come from a ``ByteSource``."""

    use_ns = True

    def __init__(self, tree: Tree, source: ByteSource, on_ready: Callable[[], None] | None = None) -> None:
        self.tree = tree
        self.source = source
        self._read_source = source.read_into  # bound once: fill runs once per request
        self._on_ready = on_ready
        self._uid = os.getuid()
        self._gid = os.getgid()
        self.open_files: dict[int, FileNode] = {}  # by file handle: the file's inode
        self.served = False  # set once the kernel has connected
        self.readahead = Readahead()  # tuned by the daemon once the mount answers
        self._failed_sources: set[str] = set()
        self.failed_reads = FailedReads(caller_pid)  # so that the kernel's second ask for a failed read fails at once

    def init(self, path: str) -> None:
        self.served = True
        if self._on_ready is not None:
            self._on_ready()

    def destroy(self, path: str) -> None:
        self.source.close()
        self.readahead.close()

    # -- the core every request goes through -------------------------------------------------------------------

    @eio_on_surprise
    def node(self, path: str) -> Node:
        """The node at ``path``; ``ENOENT`` if there is none."""
        node = self.tree.lookup(path)
        if node is None:
            raise FuseOSError(errno.ENOENT)
        return node

    def stat(self, node: Node) -> tuple[int, ...]:
        """The values of ``STAT_FIELDS`` for ``node`` (times in nanoseconds)."""
        mtime = node.mtime_ns
        if isinstance(node, DirNode):
            mode, links, size, blocks = DIR_MODE, 2, 0, 0
        else:  # st_blocks counts 512-byte units whatever the block size
            mode, links, size = FILE_MODE, 1, node.size
            blocks = (size + 511) // 512
        return (mode, node.inode, links, size, blocks, PAGE, self._uid, self._gid, mtime, mtime, mtime)

    @eio_on_surprise
    def entries(self, path: str) -> list[tuple[str, Node]]:
        """The listing of folder ``path``: ``.``, ``..``, then its entries; ``ENOENT`` or ``ENOTDIR`` otherwise."""
        node = self.node(path)
        if type(node) is not DirNode:
            raise FuseOSError(errno.ENOTDIR)
        return [(".", node), ("..", node.parent), *node.children.items()]

    @eio_on_surprise
    def file(self, path: str | None, fh: int) -> FileNode:
        """The file a read names: by handle, else by path; ``EISDIR`` for a folder."""
        node = self.open_files.get(fh)
        if node is None and path is not None:
            found = self.node(path)
            if isinstance(found, DirNode):
                raise FuseOSError(errno.EISDIR)
            node = found
        if node is None:
            raise FuseOSError(errno.EBADF)
        return node

    def fill(self, node: FileNode, view: memoryview, offset: int) -> int:
        """Copy ``node``'s bytes from ``offset`` into the start of ``view``; the count, clamped at its end."""
        try:
            return read_into(node, offset, view, self._read_source)
        except FuseOSError:
            raise
        except Exception as exc:
            raise self.failed(
                next((s.key for s in node.segments if not isinstance(s, bytes)), ""), offset, exc
            ) from exc

    def failed(self, key: str, offset: int, exc: Exception) -> FuseOSError:
        """The ``EIO`` a failed read of source ``key`` answers with; logged once per source (a truncated
        source under a busy reader would otherwise fill the log)."""
        # SourceChanged: the source has logged its one line already
        level = logging.DEBUG if key in self._failed_sources or isinstance(exc, SourceChanged) else logging.ERROR
        self._failed_sources.add(key)
        log.log(
            level,
            "read of %s at %d failed: %s (further failures of it are logged at debug level)",
            key,
            offset,
            exc,
            exc_info=not isinstance(exc, OSError),
        )
        return FuseOSError(errno.EIO)

    # -- mfusepy's callbacks, over the core ---------------------------------------------------------------------

    @eio_on_surprise
    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        node = self.file(None, fh or 0) if path is None else self.node(path)  # by handle: an open file
        return dict(zip(STAT_FIELDS, self.stat(node), strict=True))

    @eio_on_surprise
    def readdir(self, path: str, fh: int) -> list[Any]:
        # use_ino: an entry with inode 0 is skipped by readdir(3), so "." and ".." carry theirs
        return [(name, {"st_mode": file_mode(node), "st_ino": node.inode}, 0) for name, node in self.entries(path)]

    @eio_on_surprise
    def open(self, path: str, flags: int) -> int:
        node = self.node(path)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND):
            raise FuseOSError(errno.EROFS)
        if isinstance(node, DirNode):
            raise FuseOSError(errno.EISDIR)
        self.readahead.opened(self.tree.readahead_kb.get(node.inode, 0))
        self.open_files[node.inode] = node
        return node.inode

    @eio_on_surprise
    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        node = self.file(path, fh)
        if self.failed_reads and self.failed_reads.asked_again(node.inode, offset):
            raise FuseOSError(errno.EIO)  # the kernel asking again for a read that just failed
        buffer = bytearray(clamp(node, offset, size))
        try:
            count = self.fill(node, memoryview(buffer), offset)
        except FuseOSError as exc:
            if exc.errno == errno.EIO:
                self.failed_reads.add(node.inode, offset, size)
            raise
        return bytes(buffer) if count == len(buffer) else bytes(buffer[:count])

    @eio_on_surprise
    def statfs(self, path: str) -> dict[str, int]:
        return {
            "f_bsize": PAGE,
            "f_frsize": PAGE,
            "f_blocks": (self.tree.data_size + PAGE - 1) // PAGE,
            "f_bfree": 0,
            "f_bavail": 0,
            "f_files": self.tree.file_count,
            "f_ffree": 0,
            "f_favail": 0,
            "f_namemax": NAME_MAX,
        }

    @eio_on_surprise
    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
        node = self.node(path)
        if node is self.tree.root and name == CHANGED_XATTR:
            return self.changed_sources()
        xattrs = self._xattrs(node)
        if name not in xattrs:
            raise FuseOSError(ENOATTR)
        return xattrs[name]

    @eio_on_surprise
    def listxattr(self, path: str) -> list[str]:
        node = self.node(path)
        return [*self._xattrs(node), *([CHANGED_XATTR] if node is self.tree.root else [])]

    def _xattrs(self, node: Node) -> dict[str, bytes]:
        if type(node) is FileNode:
            return tensor_xattrs(node)
        if node is self.tree.root:  # which process serves this mount: for `kill`, monitoring and tests
            return {DAEMON_PID_XATTR: str(os.getpid()).encode()}
        return {}

    def changed_sources(self) -> bytes:
        """``user.stfs.changed``: the sources whose path no longer holds the mounted file, as a sorted JSON
        array (asked of the source each time: a stat per local file)."""
        return json.dumps(self.source.changed(), ensure_ascii=False).encode("utf-8", "surrogateescape")

    @eio_on_surprise
    def access(self, path: str, amode: int) -> int:
        self.node(path)
        if amode & os.W_OK:
            raise FuseOSError(errno.EROFS)
        return 0

    def release(self, path: str, fh: int) -> int:
        return 0

    # Every mutating call: the mount is read-only.
    chmod = chown = create = link = mkdir = mknod = rename = rmdir = _read_only
    setxattr = removexattr = symlink = truncate = unlink = utimens = write = _read_only
