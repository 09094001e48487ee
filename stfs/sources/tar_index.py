"""The members of a tar, found by reading its headers only: each a range of the archive.

Python's ``tarfile`` parses the headers (ustar, GNU long names, PAX records) from a file object that reads the
archive in windows of ``WINDOW`` bytes on demand (a Range request each, for a registry's blob) and seeks over
member data without reading it. A member's bytes are ``[offset, offset + size)`` of the archive. ``entries``
reads any seekable file object (a gzip layer's decompressed stream too) and keeps folders and links as well.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

WINDOW = 256 << 10  # bytes read at once: a run of small members' headers comes in one request
MAX_MEMBERS = 200_000  # members of one archive: their list stays in memory (a whole OS image has ~50,000)


@dataclass(frozen=True, slots=True)
class Member:
    """A regular file in the archive: its path as stored (PAX or GNU long name included), where its bytes are."""

    path: str
    offset: int
    size: int
    mtime: float


@dataclass(frozen=True, slots=True)
class Entry:
    """A member of any kind stfs keeps: ``kind`` is ``file``, ``folder``, ``hardlink`` or ``symlink`` (``target``
    the link's name as stored); a file's bytes are ``[offset, offset + size)`` of the archive's stream."""

    path: str
    kind: str
    offset: int = 0
    size: int = 0
    mtime: float = 0.0
    target: str = ""


class TarIndexError(ValueError):
    """The archive is not a tar stfs can index (the message says why); the caller names the archive."""


class _RangeFile(io.RawIOBase):
    """A read-only, seekable file over ``read(offset, size)``, which is asked for whole windows."""

    def __init__(self, read: Callable[[int, int], bytes], size: int) -> None:
        self._read = read
        self._size = size
        self._position = 0
        self._window = (0, b"")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view) and self._position < self._size:
            start, data = self._window
            if not start <= self._position < start + len(data):
                start = self._position
                data = self._read(start, min(max(WINDOW, len(view) - done), self._size - start))
                if not data:
                    break
                self._window = (start, data)
            piece = data[self._position - start : self._position - start + len(view) - done]
            view[done : done + len(piece)] = piece
            done += len(piece)
            self._position += len(piece)
        return done


def members(read: Callable[[int, int], bytes], size: int) -> list[Member]:
    """The regular members of the tar archive of ``size`` bytes that ``read(offset, count)`` reads, in order."""
    stream = io.BufferedReader(_RangeFile(read, size))
    return [
        Member(entry.path, entry.offset, entry.size, entry.mtime)
        for entry in entries(stream, size, MAX_MEMBERS)
        if entry.kind == "file"
    ]


def entries(stream: BinaryIO, end: int, max_members: int, past: str = "") -> Iterator[Entry]:
    """The members of the tar archive ``stream`` holds (files, folders, hard and symbolic links; devices and the
    data of sparse files left out), in order; a ``TarIndexError`` where a member ends past ``end`` or there are
    more than ``max_members`` (``past``: what to say instead of "ends past the archive"). The caller reads
    ``stream`` no further than the members' headers and data."""
    count = 0
    try:
        with tarfile.open(fileobj=stream, mode="r:") as archive:
            while (info := archive.next()) is not None:
                count += 1
                if count > max_members:
                    raise TarIndexError(f"more than {max_members} members")
                if info.offset_data + info.size > end:
                    raise TarIndexError(f"member {info.name!r} ends past " + (past or "the archive"))
                archive.members.clear()  # type: ignore[attr-defined]  # tarfile keeps every member it reads: a million of them would stay
                if info.isreg() and info.sparse is None:
                    yield Entry(info.name, "file", info.offset_data, info.size, float(info.mtime))
                elif info.isdir():
                    yield Entry(info.name, "folder", mtime=float(info.mtime))
                elif info.islnk():
                    yield Entry(info.name, "hardlink", target=info.linkname)
                elif info.issym():
                    yield Entry(info.name, "symlink", target=info.linkname)
    except tarfile.TarError as exc:
        raise TarIndexError(str(exc) or type(exc).__name__) from None
