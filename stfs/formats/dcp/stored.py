"""What a DCP's ``.distcp`` files hold where its ``.metadata`` says: each chunk a ``torch.save`` of one tensor (read
as a PyTorch checkpoint, never loaded: its central directory, pickle and local headers, not its data), each bytes
entry a ``torch.save`` of an object (its pickle interpreted for ``metadata/``) or the raw bytes of a ``BytesIO``.

The archives of a file are read ahead at once, a ``HEAD`` and a ``TAIL`` of each (all of a small one): the ranges of
consecutive archives touch, so a file of many chunks costs about one read each, all asked for together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..base import RangeFetcher, encodable, read_ranges
from ..pytorch import read_checkpoint, zip_object
from ..pytorch.checkpoint import Tensor
from ..pytorch.rules import PytorchError
from ..pytorch.values import describe
from .metadata import Chunk, Stored
from .rules import InvalidChunk

HEAD = 1024  # of each archive read ahead: its first local header, its pickle, its storage's local header
TAIL = 1024  # and its end: the central directory and the end records
WHOLE = HEAD + TAIL + 2048  # an archive this small is read whole
BYTES_VALUE_LIMIT = 1 << 20  # a bytes entry is read for its value up to this size


@dataclass(frozen=True, slots=True)
class Job:
    """A chunk of the tensor ``fqn`` (``chunk``), or its bytes entry (``chunk`` ``None``), where it is stored."""

    fqn: str
    stored: Stored
    chunk: Chunk | None = None


@dataclass(frozen=True, slots=True)
class ChunkTensor:
    """A chunk as its ``torch.save`` holds it: the tensor (``storage_start`` absolute in its ``file``) and the globals
    its pickle names that ``torch.load(weights_only=True)`` refuses."""

    tensor: Tensor
    file: str
    unsafe_globals: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BytesValue:
    """A bytes entry for ``metadata/``: its value as text, and the globals its pickle names that
    ``torch.load(weights_only=False)``, as DCP loads it, would import and call."""

    text: str
    unsafe_globals: tuple[str, ...]


class _Archive:
    """The ``length`` bytes of a ``torch.save`` at ``start`` of its file, as a ``Read`` from their start: served from
    the ``head`` and ``tail`` read ahead where they hold what is asked, else fetched; short at their end, as a file's
    read is at the file's."""

    def __init__(self, fetch: RangeFetcher, start: int, length: int, head: bytes, tail: bytes) -> None:
        self.fetch = fetch
        self.start = start
        self.length = length
        self.head = head
        self.tail = tail

    def __call__(self, offset: int, size: int) -> bytes:
        size = max(0, min(size, self.length - offset))
        if offset + size <= len(self.head):
            return self.head[offset : offset + size]
        tail_start = self.length - len(self.tail)
        if offset >= tail_start:
            return self.tail[offset - tail_start : offset - tail_start + size]
        return self.fetch(self.start + offset, size)

    def many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return [self(offset, size) for offset, size in ranges]


def archives(fetch: RangeFetcher, jobs: Sequence[Job], path: str) -> Iterator[tuple[Job, _Archive]]:
    """Each job of one file, whose bytes ``fetch`` reads, with its archive read ahead (all at once)."""
    ranges = []
    for job in jobs:
        offset, length = job.stored.offset, job.stored.length
        if length <= WHOLE:
            ranges.append((offset, length))
        else:
            ranges += [(offset, HEAD), (offset + length - TAIL, TAIL)]
    many = getattr(fetch, "many", None) or (lambda wanted: [fetch(offset, size) for offset, size in wanted])
    blocks = iter(read_ranges(many, ranges, path))
    for job in jobs:
        head = next(blocks)
        tail = next(blocks) if job.stored.length > WHOLE else b""
        yield job, _Archive(fetch, job.stored.offset, job.stored.length, head, tail)


def chunk_tensor(job: Job, archive: _Archive, dtype: str, path: str) -> ChunkTensor:
    """The tensor a chunk's ``torch.save`` holds: exactly one, of the chunk's ``dtype`` (safetensors' name) and
    sizes; ``InvalidChunk`` naming the chunk otherwise."""
    assert job.chunk is not None
    stored = job.stored
    where = f"its chunk at offsets {list(job.chunk.offsets)} ({stored.file} bytes {stored.offset}+{stored.length})"
    try:
        checkpoint = read_checkpoint(
            archive, stored.length, path=stored.file, head=archive.head, read_many=archive.many
        )
    except PytorchError as exc:
        raise InvalidChunk(path, f"{where} is no torch.save: {type(exc).__name__}: {exc.detail}", job.fqn) from None
    tensors = checkpoint.tensors
    if len(tensors) != 1 or checkpoint.left_out or tensors[0].name != "":
        held = [tensor.name for tensor in tensors] + [item.name for item in checkpoint.left_out]
        raise InvalidChunk(path, f"{where} holds the tensors {held}, not one tensor", job.fqn)
    tensor = tensors[0]
    if tensor.dtype != dtype or tensor.shape != job.chunk.sizes:
        raise InvalidChunk(
            path,
            f"{where} holds a {tensor.dtype} tensor of shape {list(tensor.shape)}; its metadata says {dtype} of "
            f"{list(job.chunk.sizes)}",
            job.fqn,
        )
    placed = dataclasses.replace(tensor, storage_start=stored.offset + tensor.storage_start)
    return ChunkTensor(placed, stored.file, checkpoint.unsafe_globals)


def bytes_value(job: Job, archive: _Archive | None) -> BytesValue:
    """A bytes entry's value as ``metadata/`` shows it: a number, a string or a bool as it is, anything else named
    (``a dict of 3``) with its size; ``archive`` ``None``: too large to read at mount."""
    stored = job.stored
    size = f"{stored.length} bytes in {stored.file}"
    if archive is None:
        return BytesValue(f"{size}, not read", ())
    if archive.head[:4] != b"PK\x03\x04":  # a BytesIO of the state dict, stored as it is
        return BytesValue(size, ())
    try:
        value, unsafe = zip_object(archive, archive.many, stored.length, stored.file)
    except PytorchError as exc:
        return BytesValue(f"{size}, not a torch.save stfs reads: {type(exc).__name__}: {exc.detail}", ())
    return BytesValue(_text(value) if _plain(value) else f"{describe(value)}, {size}", unsafe)


def _plain(value: Any) -> bool:
    """A value ``metadata/`` shows as it is: ``None``, a number, a bool, a string of valid Unicode (a pickle's
    string may hold a lone surrogate) of at most 4096 characters."""
    return value is None or (
        type(value) in (int, float, bool, str) and len(_text(value)) <= 4096 and encodable(_text(value))
    )


def _text(value: Any) -> str:
    return str(value) if not (type(value) is int and value.bit_length() > 4000) else "a huge integer"
