"""A DCP tensor's bytes in C order, gathered from its chunks across the files of its folder (``Assembled``, the
format seam's ``Scattered``).

A chunk is a box of the tensor (offsets, sizes), each stored as a ``torch.save`` of that box (``Piece``: its file
and the tensor its archive holds, strided or not). Its elements in its own C order are in the tensor's C order too,
so the elements of any run of the tensor that a chunk holds are one run of the chunk's: a read of the tensor is, for
each chunk it meets, one read of that chunk's bytes (gathered, for a strided one) put in place, a slice where the run
is one in the tensor as well (a tensor sharded along its first dimension), scattered by index otherwise.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..base import Read, Rows
from ..gather import GATHER_ELEMENTS, gather_into
from ..pytorch.checkpoint import Tensor

PLANES = 64  # planes (the last two dimensions) of a chunk a read puts in place one at a time, at most

if TYPE_CHECKING:
    from numpy.typing import NDArray


@dataclass(frozen=True, slots=True)
class Piece:
    """A chunk that holds elements: its box in the tensor, the file of its ``torch.save`` and the tensor that holds
    (``storage_start`` absolute in that file), and the tensor's indices in C order of its first and last element."""

    file: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: Tensor
    first: int
    last: int

    @property
    def volume(self) -> int:
        return self.tensor.numel


def piece(file: str, offsets: tuple[int, ...], sizes: tuple[int, ...], tensor: Tensor, shape: tuple[int, ...]) -> Piece:
    """The ``Piece`` of a chunk of ``sizes`` at ``offsets`` of a tensor of ``shape`` (of one element at least)."""
    strides = _strides(shape)
    first = sum(o * s for o, s in zip(offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, sizes, strides, strict=True))
    return Piece(file, offsets, sizes, tensor, first, last)


@dataclass(frozen=True, slots=True)
class Assembled:
    """A tensor of ``shape`` whose elements lie in ``pieces`` (sorted by their first element; together they hold
    every element once), gathered in C order as read."""

    shape: tuple[int, ...]
    itemsize: int
    pieces: tuple[Piece, ...]

    @property
    def offset(self) -> int:
        """Absolute offset of its first element in the file of the piece that holds it."""
        return self.pieces[0].tensor.offset

    @property
    def span(self) -> tuple[int, int]:
        return self.pieces[0].tensor.span

    def layout(self, limit: int) -> tuple[Rows | bytes, ...] | str:
        """Its bytes in C order as ``Rows`` of runs of its chunks' files (``formats.Rows``), at most ``limit`` parts.

        Past the last dimension ``t`` that some chunk cuts, every chunk holds whole rows: a chunk's elements with
        one index of the dimensions before ``t`` are one run of it and of the tensor (a segment). A tensor row (an
        index of those dimensions) is its chunks' segments side by side, in the order of their offsets along
        ``t``. Rows whose chunks are the same, one after another, are one ``Rows``: each chunk's segments follow
        one another in it as well where it holds the whole of every dimension from there to ``t``, and along the
        last dimension before those that a chunk cuts, over a band no chunk's edge crosses."""
        size = self.itemsize
        shape, parts = self.shape, self.pieces
        if not parts:
            return ()
        if any(not part.tensor.contiguous for part in parts):
            return "a chunk is stored strided"
        cut = [d for d in range(len(shape)) if any(part.sizes[d] != shape[d] for part in parts)]
        if not cut:  # one chunk holds it all (no dimensions, or a checkpoint of one process)
            part = parts[0]
            return (Rows(1, ((part.file, part.tensor.offset, part.tensor.nbytes, part.tensor.nbytes),)),)
        t = cut[-1]
        inner = math.prod(shape[t + 1 :]) * size  # bytes of a chunk's segment, per element along t
        k = max((d + 1 for d in cut if d < t), default=0)  # dimensions k..t-1 are whole in every chunk
        run = math.prod(shape[k:t])  # rows along them: one after another in each chunk, as in the tensor
        prefixes = math.prod(shape[: max(k - 1, 0)])
        if k and prefixes * len({part.offsets[k - 1] for part in parts}) > limit:
            return f"its chunks make more than {limit} runs"
        blocks: list[Rows | bytes] = []
        count = 0
        for prefix in _indices(shape[: max(k - 1, 0)]):
            holding = [
                part
                for part in parts
                if all(o <= i < o + n for i, o, n in zip(prefix, part.offsets, part.sizes, strict=False))
            ]
            if k == 0:
                bands = [(0, 1)]
            else:
                edges = sorted(
                    {e for part in holding for e in (part.offsets[k - 1], part.offsets[k - 1] + part.sizes[k - 1])}
                )
                bands = list(itertools.pairwise(edges))
            for low, high in bands:
                index = (*prefix, low) if k else ()
                row = sorted(
                    (
                        part
                        for part in holding
                        if not k or part.offsets[k - 1] <= low < part.offsets[k - 1] + part.sizes[k - 1]
                    ),
                    key=lambda part: part.offsets[t],
                )
                count += len(row)
                if count > limit:
                    return f"its chunks make more than {limit} runs"
                segments = tuple(
                    (
                        part.file,
                        part.tensor.offset + _local_row(part, index, t) * part.sizes[t] * inner,
                        part.sizes[t] * inner,
                        part.sizes[t] * inner,
                    )
                    for part in row
                )
                blocks.append(Rows((high - low) * run, segments))
        return tuple(blocks)

    def read_into(self, read: Read, begin: int, view: memoryview) -> None:
        """Fill ``view`` with its bytes from ``begin`` (within its size): ``GATHER_ELEMENTS`` elements at a time, put
        in ``view`` itself where they start and end on whole elements."""
        import numpy as np

        size = self.itemsize
        end = begin + len(view)
        done = 0
        while begin + done < end:
            first = (begin + done) // size
            stop = min((end - 1) // size + 1, first + GATHER_ELEMENTS)
            skip = begin + done - first * size
            length = min(end - begin - done, (stop - first) * size - skip)
            if skip == 0 and length == (stop - first) * size:
                self._fill(read, first, stop, np.frombuffer(view[done : done + length], dtype=np.uint8))
            else:
                out = np.empty((stop - first) * size, dtype=np.uint8)
                self._fill(read, first, stop, out)
                view[done : done + length] = out[skip : skip + length].tobytes()
            done += length

    def _fill(self, read: Read, first: int, stop: int, out: NDArray[Any]) -> None:
        """Put elements ``first`` to ``stop`` (excluded) into ``out``, bytes from element ``first``."""
        import numpy as np

        strides = _strides(self.shape)
        for part in self.pieces:
            if part.first >= stop:
                break  # sorted by their first element: none after holds one of these
            if part.last < first:
                continue
            low, high = _before(part, first, self.shape, strides), _before(part, stop, self.shape, strides)
            if low < high:
                data = np.frombuffer(_piece_bytes(part, read, low, high), dtype=np.uint8)
                _place(part, data, low, high, out, first, strides, self.itemsize)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-order strides of ``shape``, in elements."""
    strides = []
    step = 1
    for length in reversed(shape):
        strides.append(step)
        step *= length
    return tuple(reversed(strides))


def _indices(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Every index of ``shape`` in C order (one, ``()``, of no dimensions)."""
    return itertools.product(*(range(n) for n in shape))


def _local_row(part: Piece, index: tuple[int, ...], t: int) -> int:
    """The row of ``part`` (an index of its dimensions before ``t``, in its C order) where the tensor's row ``index``
    (its first dimensions; the rest 0) lies."""
    row = 0
    for d in range(t):
        row = row * part.sizes[d] + (index[d] - part.offsets[d] if d < len(index) else 0)
    return row


def _before(part: Piece, index: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """How many of ``part``'s elements come before the tensor's element ``index`` in C order (``index`` may be the
    tensor's element count): so the piece's elements from ``_before(first)`` to ``_before(stop)`` are those of the
    tensor's from ``first`` to ``stop``, one run of the piece's own C order."""
    if index <= part.first:
        return 0
    if index > part.last:
        return part.volume
    count = 0
    rest = part.volume
    for offset, length, stride, whole in zip(part.offsets, part.sizes, strides, shape, strict=True):
        rest //= length
        low = index // stride % whole - offset
        if low < 0:
            return count
        if low >= length:
            return count + length * rest
        count += low * rest
    return count


def _index(part: Piece, local: int, strides: tuple[int, ...]) -> int:
    """The tensor's index of the element ``local`` of ``part`` (in its C order)."""
    index = 0
    for offset, length, stride in zip(reversed(part.offsets), reversed(part.sizes), reversed(strides), strict=True):
        index += (local % length + offset) * stride
        local //= length
    return index


def _place(
    part: Piece,
    data: NDArray[Any],
    low: int,
    high: int,
    out: NDArray[Any],
    first: int,
    strides: tuple[int, ...],
    size: int,
) -> None:
    """Put ``data``, the bytes of ``part``'s elements ``low`` to ``high`` in its C order, where they go in ``out``
    (the tensor's bytes from element ``first``): a slice where they are one run of the tensor too; else row by row
    of the piece's last dimension, each plane's whole rows at once (one strided copy, rows ``strides[-2]`` apart);
    scattered by index where planes are too many to take one at a time (short rows in a deep tensor)."""
    import numpy as np

    at = _index(part, low, strides)
    if _index(part, high - 1, strides) - at == high - 1 - low:
        out[(at - first) * size : (at - first + high - low) * size] = data
        return
    row, rows = part.sizes[-1], part.sizes[-2] * part.sizes[-1]  # elements of a row and of a plane of the piece
    if (high - low) // rows <= PLANES:
        position = low
        while position < high:
            row_end = min(high, (position // row + 1) * row)
            plane_end = min(high, (position // rows + 1) * rows)
            whole = (plane_end - position) // row if position % row == 0 else 0
            stop = position + whole * row if whole > 1 else row_end
            begin = (_index(part, position, strides) - first) * size
            chunk = data[(position - low) * size : (stop - low) * size]
            if stop == row_end:  # within one row: a run of the tensor
                out[begin : begin + len(chunk)] = chunk
            else:
                target = np.lib.stride_tricks.as_strided(
                    out[begin:], shape=(whole, row * size), strides=(strides[-2] * size, 1), writeable=True
                )
                target[...] = chunk.reshape(whole, row * size)
            position = stop
        return
    local = np.arange(low, high, dtype=np.int64)
    where = np.zeros(len(local), dtype=np.int64)
    for offset, length, stride in zip(reversed(part.offsets), reversed(part.sizes), reversed(strides), strict=True):
        where += (local % length + offset) * stride
        local //= length
    item = np.dtype(f"V{size}")
    out.view(item)[where - first] = data.view(item)


def _piece_bytes(part: Piece, read: Read, low: int, high: int) -> bytes:
    """The bytes of ``part``'s elements ``low`` to ``high`` (excluded) in its C order: one range of its file, or
    gathered from its storage where its ``torch.save`` holds a strided tensor."""
    tensor, size = part.tensor, part.tensor.itemsize
    first, length = tensor.span
    span = (first, first + length)  # a remote source fetches and reads ahead within the chunk, not past it
    if tensor.contiguous:
        return read(tensor.offset + low * size, (high - low) * size, part.file, span)
    found = bytearray((high - low) * size)
    gather_into(tensor, lambda offset, count: read(offset, count, part.file, span), low * size, memoryview(found))
    return bytes(found)


def covers(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[str, str] | None:
    """Whether the boxes ``(offsets, sizes)`` (each inside ``shape``, none empty) hold each element of ``shape`` once:
    ``None``, or ``("overlap", why)`` / ``("hole", why)``. Swept along the dimension with the most distinct offsets:
    a box is compared only with those that start before it ends there."""
    if boxes and shape:
        axis = max(range(len(shape)), key=lambda d: len({offsets[d] for offsets, _ in boxes}))
        ordered = sorted(boxes, key=lambda box: box[0][axis])
        for i, (offsets, sizes) in enumerate(ordered):
            end = offsets[axis] + sizes[axis]
            for other, other_sizes in ordered[i + 1 :]:
                if other[axis] >= end:
                    break
                if all(
                    max(a, b) < min(a + m, b + n) for a, m, b, n in zip(offsets, sizes, other, other_sizes, strict=True)
                ):
                    return "overlap", f"the chunks at offsets {list(offsets)} and {list(other)} share elements"
    elif len(boxes) > 1:  # two chunks of a tensor of no dimensions: its one element twice
        return "overlap", f"{len(boxes)} chunks hold its one element"
    held = sum(math.prod(sizes) for _, sizes in boxes)
    if held != math.prod(shape):
        return "hole", f"its chunks hold {held} of its {math.prod(shape)} elements"
    return None
