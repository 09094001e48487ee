"""A strided tensor's bytes in C order, gathered from its storage: every format's whose tensors are a shape and
strides over a run of bytes (a PyTorch checkpoint's transpose, a Fortran-order NumPy array), as a ``Scattered``."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .base import RangeFetcher, Rows, read_exact

if TYPE_CHECKING:
    from numpy.typing import NDArray


class Elements(Protocol):
    """Where a strided tensor's elements lie: ``storage_offset`` and ``strides`` count elements of ``itemsize``
    bytes from the absolute ``storage_start`` of its file."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def strides(self) -> tuple[int, ...]: ...
    @property
    def itemsize(self) -> int: ...
    @property
    def storage_offset(self) -> int: ...
    @property
    def storage_start(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Strided:
    """A tensor of ``shape`` whose element (i, j, ...) lies at element ``storage_offset + i*strides[0] + ...`` from
    ``storage_start``, as a ``Scattered``: its elements gathered in C order as read."""

    storage_start: int
    storage_offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int

    @property
    def offset(self) -> int:
        return self.storage_start + self.storage_offset * self.itemsize

    @property
    def span(self) -> tuple[int, int]:
        if 0 in self.shape:
            return (self.offset, 0)
        last = sum((size - 1) * stride for size, stride in zip(self.shape, self.strides, strict=True))
        return (self.offset, (last + 1) * self.itemsize)

    def read_into(self, read: RangeFetcher, begin: int, view: memoryview) -> None:
        gather_into(self, read, begin, view)

    def layout(self, limit: int) -> tuple[Rows | bytes, ...] | str:
        return strided_layout(self, limit)


GATHER_WINDOW = 8 << 20  # the most bytes of a storage one read of a strided tensor asks for
GATHER_GAP = 64 << 10  # elements further apart than this are read apart (a gap costs more than another read)
GATHER_ELEMENTS = 1 << 18  # elements of a strided tensor gathered at once: their positions are 2 MiB of int64


def gather_into(tensor: Elements, read: RangeFetcher, begin: int, view: memoryview) -> None:
    """Fill ``view`` with the bytes from ``begin`` of the tensor's elements in C order (within ``nbytes``).

    Bounded whatever the tensor's size: ``GATHER_ELEMENTS`` elements at a time, whose positions in the storage are
    sorted and read in windows of at most ``GATHER_WINDOW`` bytes, split where they lie ``GATHER_GAP`` apart (a
    slice with a large step, or the rows of a transpose, read as the parts that hold them).
    """
    import numpy as np

    size = tensor.itemsize
    end = begin + len(view)
    done = 0
    while begin + done < end:
        first = (begin + done) // size
        last = min((end - 1) // size, first + GATHER_ELEMENTS - 1)
        index = np.arange(first, last + 1, dtype=np.int64)
        positions = np.full(index.shape, tensor.storage_offset, dtype=np.int64)
        for dim, stride in zip(reversed(tensor.shape), reversed(tensor.strides), strict=True):
            positions += (index % dim) * stride
            index //= dim
        out = gather_positions(read, tensor.storage_start, positions * size, size)
        chunk = memoryview(out.view(np.uint8).data)
        skip = begin + done - first * size
        length = min(end - begin - done, len(chunk) - skip)
        view[done : done + length] = chunk[skip : skip + length]
        done += length


def gather_positions(read: RangeFetcher, start: int, positions: NDArray[Any], size: int) -> NDArray[Any]:
    """The elements of ``size`` bytes at byte ``positions`` from the absolute ``start`` of a file, as an array of
    ``V{size}``: the positions sorted and read in windows of at most ``GATHER_WINDOW`` bytes, split where they lie
    ``GATHER_GAP`` apart (only the parts that hold them are read)."""
    import numpy as np

    item = np.dtype(f"V{size}")
    order = np.argsort(positions, kind="stable")
    ordered = positions[order]
    gaps = np.flatnonzero(np.diff(ordered) > GATHER_GAP)
    out = np.empty(len(ordered), dtype=item)
    begin = 0
    while begin < len(ordered):
        stop = int(np.searchsorted(ordered, ordered[begin] + GATHER_WINDOW, side="left"))
        cut = int(np.searchsorted(gaps, begin, side="left"))
        if cut < len(gaps) and gaps[cut] + 1 < stop:
            stop = int(gaps[cut]) + 1
        low = int(ordered[begin])
        raw = read_exact(read, start + low, int(ordered[stop - 1]) - low + size, "<gather>")
        relative = ordered[begin:stop] - low
        if not np.any(relative % size):  # whole elements from the window's start: one view of it
            out[order[begin:stop]] = np.frombuffer(raw, dtype=item)[relative // size]
        else:
            picks = relative[:, None] + np.arange(size)
            out[order[begin:stop]] = np.frombuffer(raw, dtype=np.uint8)[picks].view(item).reshape(-1)
        begin = stop
    return out


def strided_layout(tensor: Elements, limit: int) -> tuple[Rows | bytes, ...] | str:
    """A strided tensor's bytes in C order as ``Rows`` of runs of its storage (``formats.Rows``), at most ``limit``
    parts: its last dimensions that lie in C order are one run (a segment); the dimensions before them whose strides
    go on from one to the next make one ``Rows`` of segments a stride apart; one for each index of the rest. A tensor
    whose last dimension is strided (a transpose) is a run per element: why not, instead."""
    size = tensor.itemsize
    dims = [(n, stride) for n, stride in zip(tensor.shape, tensor.strides, strict=True) if n != 1]
    if any(n == 0 for n, _ in dims):
        return ()
    inner = 1  # elements of a segment
    while dims and dims[-1][1] == inner:
        inner *= dims.pop()[0]
    if inner == 1 and dims:
        return "its last dimension is strided: every element is a run of its own"
    first = tensor.storage_start + tensor.storage_offset * size
    if not dims:
        return (Rows(1, ((None, first, inner * size, inner * size),)),)
    rows, stride = dims.pop()
    while dims and dims[-1][1] == stride * rows:  # rows that go on from one another
        rows *= dims.pop()[0]
    outer = dims
    if math.prod(n for n, _ in outer) > limit:
        return f"it is more than {limit} runs"
    blocks = []
    for index in itertools.product(*(range(n) for n, _ in outer)):
        at = first + sum(i * s for i, (_, s) in zip(index, outer, strict=True)) * size
        blocks.append(Rows(rows, ((None, at, inner * size, stride * size),)))
    return tuple(blocks)
