"""The regular members of an uncompressed tar, found by reading its headers only: each a range of the archive.

Python's ``tarfile`` parses the headers (ustar, GNU long names, PAX records) from a file object that reads the
archive in windows of ``WINDOW`` bytes on demand (a Range request each, for a registry's blob) and seeks over
member data without reading it. A member's bytes are ``[offset, offset + size)`` of the archive.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from dataclasses import dataclass

WINDOW = 256 << 10  # bytes read at once: a run of small members' headers comes in one request
MAX_MEMBERS = 1_000_000


@dataclass(frozen=True, slots=True)
class Member:
    """A regular file in the archive: its path as stored (PAX or GNU long name included), where its bytes are."""

    path: str
    offset: int
    size: int
    mtime: float


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
    found: list[Member] = []
    try:
        with tarfile.open(fileobj=io.BufferedReader(_RangeFile(read, size)), mode="r:") as archive:
            for info in archive:
                if len(found) >= MAX_MEMBERS:
                    raise TarIndexError(f"more than {MAX_MEMBERS} members")
                if not info.isreg() or info.sparse is not None:
                    continue  # folders, links, devices; a sparse file's data is not its bytes
                if info.offset_data + info.size > size:
                    raise TarIndexError(f"member {info.name!r} ends past the archive")
                found.append(Member(info.name, info.offset_data, info.size, float(info.mtime)))
    except tarfile.TarError as exc:
        raise TarIndexError(str(exc) or type(exc).__name__) from None
    return found
