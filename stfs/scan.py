"""Reading whole models in bounded chunks: ``Reader`` (what ``stfs diff`` reads each side with) and
``stfs check --values`` (every tensor's NaN and infinities).

A tensor is read once, in order, by the chunked reader (``chunks.TensorBytes``) into one buffer reused for every
tensor, so memory stays the same whatever the model's size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from . import errors
from .chunks import CHUNK_BYTES, PIECE_VALUES, TensorBytes
from .model import Model, Tensor
from .progress import ByteProgress
from .sources import ByteSource
from .values import Specials, byte_count, count_specials, has_specials, may_hold_specials, values_per_chunk

# The block caches of the remote sources read at once, together (one source: all of it; diff's two: half each). Its
# pages are the process's memory; the more of it, the larger the blocks and the window fetched ahead in parallel.
REMOTE_CACHE = 128 << 20


class Reader:
    """Reads tensors and files of one source in chunks into a buffer of its own, reused for every one; counts them on
    ``progress``. A read that fails or comes short is ``UnreadableFile``."""

    def __init__(
        self, source: ByteSource, progress: ByteProgress | None = None, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        self.source = source
        self.progress = progress
        self.buffer = np.empty(chunk_bytes, dtype=np.uint8)
        self._view = self.buffer.data

    def read_into(self, key: str, offset: int, view: memoryview, span: tuple[int, int]) -> int:
        """The source's ``read_into``, whole or ``UnreadableFile``."""
        try:
            got = self.source.read_into(key, offset, view, span)
        except OSError as exc:
            raise errors.UnreadableFile(f"{key}: cannot read: {exc.strerror or exc}") from None
        if got != len(view):
            raise errors.UnreadableFile(f"{key}: cannot read: it ends at byte {offset + got}")
        return got

    def chunks(self, key: str, offset: int, size: int, step: int | None = None) -> Iterator[np.ndarray]:
        """The ``size`` bytes of ``key`` at ``offset``, ``step`` bytes at a time (the last may be shorter), each
        overwritten by the next; the range is the ``span`` of every read."""
        return self.tensor_chunks(TensorBytes(key, offset, size, "U8", (size,), self.read_into), step)

    def tensor_chunks(
        self, tensor: TensorBytes, step: int | None = None, size: int | None = None
    ) -> Iterator[np.ndarray]:
        """The first ``size`` bytes (all) of ``tensor``, ``step`` bytes at a time (whole value groups), each
        overwritten by the next."""
        for _, piece in tensor.chunks(step or len(self.buffer), self._view, size):
            if self.progress is not None:
                self.progress.update(len(piece))
            yield self.buffer[: len(piece)]


def tensor_chunks(
    reader: Reader, tensor: Tensor, step: int | None = None, size: int | None = None
) -> Iterator[np.ndarray]:
    """The first ``size`` bytes (all) of ``tensor`` in C order through ``reader``, ``step`` bytes at a time."""
    found = TensorBytes(
        tensor.file, tensor.offset, tensor.size, tensor.dtype, tensor.shape, reader.read_into, tensor.scattered
    )
    return reader.tensor_chunks(found, step, size)


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
