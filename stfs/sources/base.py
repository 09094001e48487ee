"""The interface every byte source implements: where the bytes of a mount come from.

A source names its files by *keys*: opaque strings (for local files, absolute paths) that also
appear in ``user.safetensors.file`` and in error messages.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

PAGE = 4096


class SourceChanged(OSError):
    """A source no longer holds the bytes it was mounted with (maps to EIO)."""


@runtime_checkable
class ByteSource(Protocol):
    """Reads ranges of the files of one source."""

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` with the bytes of ``key`` at ``offset``; return the count, short only at its end."""
        ...

    def close(self) -> None:
        """Release what the source holds (descriptors, connections)."""
        ...


@runtime_checkable
class SpliceSource(ByteSource, Protocol):
    """A source whose bytes can go into a pipe by reference (``splice``), never through user space."""

    def splice_into(self, key: str, offset: int, count: int, pipe: int) -> int:
        """Move ``count`` bytes of ``key`` at ``offset`` into the non-blocking pipe ``pipe``; the count moved,
        short only when the pipe is full."""
        ...
