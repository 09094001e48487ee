"""Reading whole models in bounded chunks: ``Reader`` (what ``stfs diff`` reads each side with) and
``stfs check --values`` (every tensor's NaN and infinities).

A tensor is read once, in order, in chunks of at most ``CHUNK_BYTES`` into one buffer reused for every tensor,
so memory stays the same whatever the model's size. The tensor is passed as the ``span`` of each read: a remote
source then fetches ahead within it in parallel (SPEC §7).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from . import errors
from .formats import Scattered
from .model import Model, Tensor
from .progress import ByteProgress
from .sources import ByteSource
from .values import Specials, byte_count, count_specials, has_specials, may_hold_specials, values_per_chunk

CHUNK_BYTES = 1 << 20  # read at once from a source: two of them and their scratch stay in a CPU's cache
# The block caches of the remote sources read at once, together (one source: all of it; diff's two: half each). Its
# pages are the process's memory; the more of it, the larger the blocks and the window fetched ahead in parallel.
REMOTE_CACHE = 128 << 20
PIECE_VALUES = 1 << 18  # values decoded at once (float64: 2 MiB an array, with NumPy's temporaries a few times that)


class Reader:
    """Reads byte ranges of one source in chunks into a buffer of its own, reused; counts them on ``progress``."""

    def __init__(
        self, source: ByteSource, progress: ByteProgress | None = None, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        self.source = source
        self.progress = progress
        self.buffer = np.empty(chunk_bytes, dtype=np.uint8)
        self._view = self.buffer.data

    def chunks(self, key: str, offset: int, size: int, step: int | None = None) -> Iterator[np.ndarray]:
        """The ``size`` bytes of ``key`` at ``offset``, ``step`` bytes at a time (the last may be shorter), each
        overwritten by the next; the range is the ``span`` of every read. ``UnreadableFile`` if a read fails."""
        span = (offset, offset + size)
        return self._stepped(size, step, lambda done, view: self._fill(key, offset + done, view, span))

    def gathered_chunks(self, key: str, tensor: Scattered, size: int, step: int | None = None) -> Iterator[np.ndarray]:
        """The first ``size`` bytes of the tensor ``tensor`` of ``key`` in C order, as ``chunks`` gives a range's:
        its elements gathered (``Scattered.read_into``), ``step`` bytes at a time; the part of ``key`` that holds
        them is the ``span`` of every read."""
        first, length = tensor.span
        span = (first, first + length)

        def read(offset: int, count: int) -> bytes:
            found = bytearray(count)
            self._fill(key, offset, memoryview(found), span)
            return bytes(found)

        return self._stepped(size, step, lambda done, view: tensor.read_into(read, done, view))

    def _stepped(self, size: int, step: int | None, fill: Callable[[int, memoryview], None]) -> Iterator[np.ndarray]:
        """``size`` bytes, ``step`` at a time, each put into the buffer by ``fill(bytes done, view)``."""
        step = min(step or len(self.buffer), len(self.buffer))
        done = 0
        while done < size:
            count = min(step, size - done)
            fill(done, self._view[:count])
            if self.progress is not None:
                self.progress.update(count)
            yield self.buffer[:count]
            done += count

    def _fill(self, key: str, offset: int, view: memoryview, span: tuple[int, int]) -> None:
        try:
            got = self.source.read_into(key, offset, view, span)
        except OSError as exc:
            raise errors.UnreadableFile(f"{key}: cannot read: {exc.strerror or exc}") from None
        if got != len(view):
            raise errors.UnreadableFile(f"{key}: cannot read: it ends at byte {offset + got}")


def tensor_chunks(
    reader: Reader, tensor: Tensor, step: int | None = None, size: int | None = None
) -> Iterator[np.ndarray]:
    """The first ``size`` bytes (all) of ``tensor`` in C order through ``reader``, ``step`` bytes at a time."""
    size = tensor.size if size is None else size
    if tensor.scattered is not None:
        return reader.gathered_chunks(tensor.file, tensor.scattered, size, step)
    return reader.chunks(tensor.file, tensor.offset, size, step)


def index_of(flat: int, shape: tuple[int, ...]) -> list[int]:
    """The C-order index of element ``flat`` of a tensor of ``shape`` (``[]`` for a scalar)."""
    return [int(i) for i in np.unravel_index(flat, shape)] if shape else []


@dataclass(frozen=True, slots=True)
class Found:
    """A tensor holding NaN or infinities: how many of each, and the index of the first of any."""

    tensor: Tensor
    specials: Specials

    @property
    def line(self) -> str:
        """What ``stfs check --values`` prints: the file, the tensor, the counts and where the first is."""
        tensor, specials = self.tensor, self.specials
        counts = f"{specials.nan} NaN, {specials.posinf} +inf, {specials.neginf} -inf"
        return f"{tensor.file}: tensor {tensor.name!r}: {counts}, the first at {index_of(specials.first, tensor.shape)}"


def checked(model: Model) -> list[Tensor]:
    """The tensors of ``model`` whose values can be NaN or infinite, in file order: what ``check_values`` reads."""
    return sorted((t for t in model.tensors if has_specials(t.dtype)), key=lambda t: (t.file, t.offset))


def check_values(model: Model, reader: Reader) -> list[Found]:
    """Every tensor of ``model`` holding NaN or infinities, in file order; each float tensor is read once, in chunks
    (integer, BOOL, F6, F4 and C64 tensors have none and are not read)."""
    scratch = np.empty(len(reader.buffer), dtype=np.uint8)
    out = np.empty(PIECE_VALUES, dtype=np.float64)
    found = []
    for tensor in checked(model):
        dtype = tensor.dtype
        chunk_values = values_per_chunk(len(reader.buffer), dtype)
        piece = byte_count(dtype, PIECE_VALUES)
        specials = Specials()
        for number, raw in enumerate(tensor_chunks(reader, tensor, byte_count(dtype, chunk_values))):
            if may_hold_specials(dtype, raw, scratch):
                for start in range(0, len(raw), piece):
                    first = number * chunk_values + start // piece * PIECE_VALUES
                    count_specials(dtype, raw[start : start + piece], first, specials, out)
        if specials.any:
            found.append(Found(tensor, specials))
    return found
