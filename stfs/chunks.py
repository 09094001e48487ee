"""A tensor's bytes in C order, read in bounded chunks of whole value groups: the one reader behind the files that
are made from tensors (``f32/``, ``npy/``, ``stats/``, ``png/``, a gathered tensor's file), ``stfs diff`` and
``stfs check --values``.

A tensor is ``size`` bytes of one source file from ``offset``, or, where its format says its bytes are not one
range (``formats.Scattered``: a strided tensor of a checkpoint), gathered from its file (or the files of its folder
it names: a DCP tensor's chunks) in C order as read. Either
way the whole tensor is the ``span`` of every read: a remote source fetches ahead within it in parallel (SPEC §7).

The chunk sizes, one set for every reader: ``CHUNK_BYTES`` of a source read at once, ``PIECE_VALUES`` values
decoded at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from . import stopping
from .formats import Scattered, groups
from .sources import join_key, parent_key

CHUNK_BYTES = 1 << 20  # read at once from a source (a FUSE request at most): two of them stay in a CPU's cache
PIECE_VALUES = 1 << 18  # values decoded at once (float64: 2 MiB an array, with NumPy's temporaries a few times that)

ReadInto = Callable[[str, int, memoryview, tuple[int, int]], int]  # a ByteSource's read_into(key, offset, buffer, span)


def whole_groups(dtype: str, size: int) -> int:
    """``size`` bytes rounded down to whole groups of ``dtype``'s values (at least one group)."""
    group_bytes = groups(dtype)[1]
    return max(1, size // group_bytes) * group_bytes


def piece_bytes(dtype: str) -> int:
    """The bytes of ``PIECE_VALUES`` values of ``dtype`` (whole groups: a GGML block holds 256)."""
    group_values, group_bytes = groups(dtype)
    return max(1, PIECE_VALUES // group_values) * group_bytes


class TensorBytes:
    """The ``size`` bytes of a tensor of ``dtype`` and ``shape`` in C order, read through ``read_source``: bytes
    ``offset`` on of the source file ``key``, or gathered by ``scattered``."""

    __slots__ = ("key", "offset", "size", "dtype", "shape", "read_source", "scattered")

    def __init__(
        self,
        key: str,
        offset: int,
        size: int,
        dtype: str,
        shape: tuple[int, ...],
        read_source: ReadInto,
        scattered: Scattered | None = None,
    ) -> None:
        self.key = key
        self.offset = offset
        self.size = size
        self.dtype = dtype
        self.shape = shape
        self.read_source = read_source
        self.scattered = scattered

    @property
    def count(self) -> int:
        """Values in the tensor."""
        group_values, group_bytes = groups(self.dtype)
        return self.size // group_bytes * group_values

    @property
    def span(self) -> tuple[int, int]:
        """The bytes of ``key`` that hold the tensor: ``(first, end)``."""
        if self.scattered is not None:
            first, length = self.scattered.span
            return first, first + length
        return self.offset, self.offset + self.size

    def read_into(self, start: int, view: memoryview) -> None:
        """Fill all of ``view`` with the tensor's bytes from ``start`` (within ``size``); ``OSError`` if the source is
        short."""
        whole = self.span
        if self.scattered is None:
            if self.read_source(self.key, self.offset + start, view, whole) != len(view):
                raise OSError(f"{self.key}: short read at byte {self.offset + start}")
            return

        def read(offset: int, size: int, file: str | None = None, span: tuple[int, int] | None = None) -> bytes:
            key, where = self.key, whole
            if file is not None:  # another file of its folder (a DCP tensor's chunk): the span is the chunk's
                key, where = join_key(parent_key(self.key), file), span or (offset, offset + size)
            found = bytearray(size)
            if self.read_source(key, offset, memoryview(found), where) != size:
                raise OSError(f"{key}: short read at byte {offset}")
            return bytes(found)

        self.scattered.read_into(read, start, view)

    def pieces(self) -> Iterator[tuple[int, memoryview]]:
        """``chunks`` of at most ``PIECE_VALUES`` values each: what a float64 array of that many holds, decoded."""
        return self.chunks(piece_bytes(self.dtype))

    def chunks(
        self, step: int = CHUNK_BYTES, buffer: memoryview | None = None, size: int | None = None
    ) -> Iterator[tuple[int, memoryview]]:
        """(index of its first value, its bytes) for each chunk of about ``step`` bytes of whole value groups, in
        order, of the first ``size`` bytes (all); each chunk is read into ``buffer`` (one of its own otherwise) and
        overwritten by the next. ``OSError`` if the source is short, ``stopping.Stopping`` if the mount is."""
        group_values, group_bytes = groups(self.dtype)
        size = self.size if size is None else size
        step = whole_groups(self.dtype, min(step, len(buffer)) if buffer is not None else step)
        if buffer is None:
            buffer = memoryview(bytearray(min(step, size)))
        done = 0
        while done < size:
            stopping.give_up_if_requested(self.key)  # a stop must not wait for the rest of a big tensor
            piece = buffer[: min(step, size - done)]
            self.read_into(done, piece)
            yield done // group_bytes * group_values, piece
            done += len(piece)
