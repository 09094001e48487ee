"""The FUSE layer: path -> node -> answer. errno lives here and only here."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")  # else mfusepy may load libfuse2 (128 KiB requests)

import mfusepy  # noqa: E402
from mfusepy import FuseOSError, Operations  # noqa: E402

from .source import ByteSource  # noqa: E402
from .tree import DirNode, FileNode, Node, Tree, file_mode

log = logging.getLogger(__name__)

BLOCK_SIZE = 4096
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
        self._files: dict[int, FileNode] = {}
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
        return self._attributes(self._lookup(path))

    def _attributes(self, node: Node) -> dict[str, Any]:
        size = 0 if isinstance(node, DirNode) else node.size
        return {
            "st_mode": file_mode(node),
            "st_ino": node.inode,
            "st_nlink": 2 if isinstance(node, DirNode) else 1,
            "st_size": size,
            "st_blocks": (size + 511) // 512,  # st_blocks counts 512-byte units whatever the block size
            "st_blksize": BLOCK_SIZE,
            "st_uid": self._uid,
            "st_gid": self._gid,
            "st_mtime": node.mtime_ns,
            "st_ctime": node.mtime_ns,
            "st_atime": node.mtime_ns,
        }

    @_eio_on_surprise
    def readdir(self, path: str, fh: int) -> list[Any]:
        node = self._lookup(path)
        if not isinstance(node, DirNode):
            raise FuseOSError(errno.ENOTDIR)
        parent = self.tree.lookup(os.path.dirname(path)) or node
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
        self._files[node.inode] = node
        return node.inode

    def _file(self, path: str | None, fh: int) -> FileNode:
        node = self._files.get(fh)
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
    def read_into(self, path: str | None, buffer: memoryview, offset: int, fh: int) -> int:
        """Fill ``buffer`` from ``offset`` of the file; the read is clamped at the file's end."""
        node = self._file(path, fh)
        count = max(0, min(len(buffer), node.size - offset))
        if count == 0:
            return 0
        content = node.content
        if content.data is not None:
            buffer[:count] = content.data[offset : offset + count]
            return count
        assert content.file is not None
        return self.source.read_into(content.file, content.offset + offset, buffer[:count])

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
        node = self._lookup(path)
        xattrs = node.xattrs if isinstance(node, FileNode) else {}
        if name not in xattrs:
            raise FuseOSError(mfusepy.ENOATTR)
        return xattrs[name]

    @_eio_on_surprise
    def listxattr(self, path: str) -> list[str]:
        node = self._lookup(path)
        return list(node.xattrs) if isinstance(node, FileNode) else []

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


class StfsFUSE(mfusepy.FUSE):
    """mfusepy's FUSE with a read callback that fills libfuse's buffer in place (one copy, no ``bytes``)."""

    def read(self, path: bytes | None, buf: Any, size: int, offset: int, fip: Any) -> int:
        fh = fip.contents.fh
        address = ctypes.cast(buf, ctypes.c_void_p).value or 0
        view = memoryview((ctypes.c_char * size).from_address(address)).cast("B")
        decoded = None if path is None else path.decode(self.encoding, self.errors)
        return self.operations.read_into(decoded, view, offset, fh)


def serve(operations: StfsOperations, mountpoint: str, foreground: bool = True, **options: Any) -> None:
    """Run the filesystem until it is unmounted or stopped by SIGTERM/SIGINT (blocks)."""
    try:
        StfsFUSE(operations, mountpoint, foreground=foreground, **options)
    except RuntimeError as exc:
        # libfuse's loop reports the signal that stopped it as an error; after a served mount that is a clean stop
        if not operations.served:
            raise RuntimeError(f"libfuse could not mount {mountpoint} (error {exc})") from None
        log.info("stopped by signal %s; unmounted %s", exc, mountpoint)

