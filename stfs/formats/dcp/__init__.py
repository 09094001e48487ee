"""PyTorch Distributed Checkpoints (SPEC §13): a folder that ``torch.distributed.checkpoint.save`` wrote (torchtitan,
Megatron's ``torch_dist``, NeMo 2), its ``.metadata`` and the ``__R_N.distcp`` files it names.

The format's file is the ``.metadata`` (the name it claims in a folder; a folder of models holding one in a
subfolder has that subfolder as one model): a pickle, interpreted by the PyTorch reader's interpreter and never run
(``metadata``). Each fully qualified name of a ``TensorStorageMetadata`` is a tensor holding the bytes
``format_utils.dcp_to_torch_save`` gives it: its chunks (boxes of the tensor, each stored as a ``torch.save`` of
that box in a ``.distcp`` file: ``storage_data``) read as PyTorch checkpoints through the header's ``Folder``
(``stored``; their framing, never their data) and gathered in C order as read (``assemble``); a tensor of one chunk
stored contiguously is one range of its file. Each ``BytesStorageMetadata`` (a step counter, a scheduler's state) is
a file of ``metadata/``, its value where it is a number or a string.

A Megatron-Core / NeMo ``torch_dist`` folder (``common.pt`` and ``metadata.json`` beside ``.metadata``) is one model:
``common.pt``'s tensors under ``common/``, ``metadata.json``'s keys in ``metadata/`` (``megatron``).

Refused in one line naming the ``.metadata``, the tensor and the rule (``DcpError``): a member that is not
what torch's DCP writes there; storage through transforms (``transform_descriptors``: compressed); a chunk outside
its tensor, chunks that overlap or leave a hole, a chunk with no storage, a storage outside the folder, a chunk that
is not a ``torch.save`` of one tensor of its dtype and sizes; a ``.distcp`` that is missing or short
(``errors.DataFileError``). Left out with a warning: a tensor of a dtype safetensors lacks or of a layout other than
strided, a name safetensors keeps (``__metadata__``) or one that is not UTF-8. The globals the pickle names outside
what torch's DCP writes (``pytorch.DCP_GLOBALS``) are warned of and fail ``stfs check``: torch reads ``.metadata``
with ``pickle.load``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ... import errors
from ..base import Folder, Format, Header, RangeFetcher, TensorEntry, encodable, made_header
from ..pytorch.allowed import TORCH_DTYPES
from .assemble import Assembled, covers, piece
from .megatron import METADATA_JSON, read_common
from .metadata import Metadata, TensorMeta, read_metadata
from .rules import ChunksLeaveHole, MissingChunkStorage, OverlappingChunks, TransformedStorage
from .stored import BYTES_VALUE_LIMIT, BytesValue, ChunkTensor, Job, archives, bytes_value, chunk_tensor

__all__ = ["FORMAT", "DcpEntry", "fetch_header"]


@dataclass(frozen=True, slots=True)
class DcpEntry(TensorEntry):
    """A tensor of a DCP: its bytes one range ``begin``/``end`` of ``location`` (a ``.distcp`` of its folder), or,
    ``assembled``, gathered from its chunks (``begin`` where its first element lies in ``location``). Its files'
    xattrs ``user.dcp.*`` add ``chunks``, how many hold its elements."""

    location: str | None = None
    assembled: Assembled | None = None
    chunks: int = 0

    @property
    def file(self) -> str | None:
        return self.location

    @property
    def scattered(self) -> Assembled | None:
        return self.assembled

    @property
    def xattrs(self) -> dict[str, str]:
        return {"chunks": str(self.chunks)}


def fetch_header(
    fetch: RangeFetcher,
    *,
    path: str,
    file_size: int,
    mtime_ns: int = 0,
    first_read: int = 0,
    folder: Folder | None = None,
) -> Header:
    """Read and validate the DCP whose ``.metadata`` is ``path`` (through ``fetch``) and whose ``.distcp`` files are
    those of ``folder``, as a ``Header``: its tensors (``data_start`` 0; each a range of its ``.distcp`` or assembled
    from its chunks), ``metadata/`` (``format`` ``pt`` and each bytes entry), ``header.json`` made in the safetensors
    schema, and the ``.distcp`` files it reads as ``other_files``."""
    if folder is None:
        raise errors.MissingDataFile(path, "its chunks lie in the .distcp files of its folder, which were not given")
    metadata = read_metadata(fetch, path, file_size)
    warnings: list[str] = []
    problems = [
        f"{path}: names the global {name!r}: torch.distributed.checkpoint reads .metadata with pickle.load, which "
        "would import and call it"
        for name in metadata.unknown_globals
    ]
    served = _served(metadata, path, warnings)
    jobs = [job for tensor in served for job in _chunk_jobs(tensor, metadata, path)]
    jobs += [_bytes_job(fqn, metadata, path) for fqn in metadata.byte_entries]
    by_file: dict[str, list[Job]] = {file: [] for file in _checked_files(jobs, folder, path)}
    for job in jobs:
        by_file[job.stored.file].append(job)
    dtypes = {tensor.fqn: TORCH_DTYPES[tensor.dtype][0] or "" for tensor in served}
    tensors: dict[tuple[str, tuple[int, ...]], ChunkTensor] = {}
    values: dict[str, BytesValue] = {}
    for file, mine in by_file.items():  # a file's archives read ahead at once, parsed, then let go
        read = [job for job in mine if job.chunk is not None or job.stored.length <= BYTES_VALUE_LIMIT]
        for job, archive in archives(folder.fetcher(file), read, f"{path} ({file})"):
            if job.chunk is None:
                values[job.fqn] = bytes_value(job, archive)
            else:
                tensors[(job.fqn, job.chunk.offsets)] = chunk_tensor(job, archive, dtypes[job.fqn], path)
        values |= {job.fqn: bytes_value(job, None) for job in mine if job.chunk is None and job.fqn not in values}
    entries = [_entry(tensor, tensors) for tensor in served]
    problems += [
        f"{path}: tensor {fqn!r}: a chunk names the global {name!r}, which torch.load(weights_only=True) refuses"
        for (fqn, _), chunk in tensors.items()
        for name in chunk.unsafe_globals
    ]
    problems += [
        f"{path}: {fqn!r} names the global {name!r}: DCP loads it with torch.load(weights_only=False), which would "
        "import and call it"
        for fqn, value in values.items()
        for name in value.unsafe_globals
    ]
    shown = _metadata(metadata, values, path, warnings)
    common = read_common(folder, path)  # Megatron-Core / NeMo torch_dist: common.pt and metadata.json beside
    if common is not None:
        warnings += [
            f"{path}: {METADATA_JSON} key {key!r} is left out of metadata/: taken"
            for key in common.metadata
            if key in shown
        ]
        shown |= {key: value for key, value in common.metadata.items() if key not in shown}
        warnings += common.warnings
        problems += common.problems
    return made_header(
        path=path,
        file_size=file_size,
        mtime_ns=mtime_ns,
        tensors=entries,
        metadata=shown,
        parsed=metadata,
        warnings=tuple(warnings + problems),
        check_problems=tuple(problems),
        other_files=tuple(by_file) + (common.files if common is not None else ()),
        folders={"common": common.tensors} if common is not None and common.tensors else {},
    )


def _served(metadata: Metadata, path: str, warnings: list[str]) -> list[TensorMeta]:
    """The tensors stfs serves, each checked: its chunks hold each of its elements once."""
    served = []
    for tensor in metadata.tensors:
        why = tensor.left_out
        if why is None and tensor.fqn == "__metadata__":
            why = "safetensors keeps that name for its metadata"
        elif why is None and not encodable(tensor.fqn):
            why = "its name is not valid UTF-8"
        if why is not None:
            warnings.append(f"{path}: tensor {tensor.fqn!r} left out: {why}")
            continue
        found = covers(tensor.shape, [(chunk.offsets, chunk.sizes) for chunk in tensor.chunks if chunk.volume])
        if found is not None:
            kind, detail = found
            rule = OverlappingChunks if kind == "overlap" else ChunksLeaveHole
            raise rule(path, detail, tensor.fqn)
        served.append(tensor)
    return served


def _chunk_jobs(tensor: TensorMeta, metadata: Metadata, path: str) -> Iterator[Job]:
    """Where each chunk holding elements of ``tensor`` is stored."""
    for chunk in tensor.chunks:
        if not chunk.volume:
            continue
        stored = metadata.storage.get((tensor.fqn, chunk.offsets))
        if stored is None:
            raise MissingChunkStorage(
                path, f"its chunk at offsets {list(chunk.offsets)} has no entry in storage_data", tensor.fqn
            )
        _untransformed(stored.transforms, path, tensor.fqn)
        yield Job(tensor.fqn, stored, chunk)


def _bytes_job(fqn: str, metadata: Metadata, path: str) -> Job:
    stored = metadata.storage.get((fqn, None))
    if stored is None:
        raise MissingChunkStorage(path, f"bytes entry {fqn!r} has no entry in storage_data")
    _untransformed(stored.transforms, path, fqn)
    return Job(fqn, stored)


def _untransformed(transforms: tuple[str, ...], path: str, fqn: str) -> None:
    if transforms:
        raise TransformedStorage(
            path, f"it is stored through {list(transforms)} (compressed or transformed): stfs serves stored bytes", fqn
        )


def _checked_files(jobs: list[Job], folder: Folder, path: str) -> list[str]:
    """The ``.distcp`` files the jobs read, in the order first named, each there and holding its jobs' bytes."""
    sizes: dict[str, int | None] = {}
    for job in jobs:
        file, end = job.stored.file, job.stored.offset + job.stored.length
        if file not in sizes:
            sizes[file] = folder.size(file)
        size = sizes[file]
        if size is None:
            raise errors.MissingDataFile(path, f"its bytes are in {file!r}, which is missing", job.fqn)
        if end > size:
            raise errors.DataFileTooShort(
                path, f"its bytes are [{job.stored.offset}, {end}) of {file!r}, which is {size} bytes", job.fqn
            )
    return list(sizes)


def _entry(tensor: TensorMeta, found: dict[tuple[str, tuple[int, ...]], ChunkTensor]) -> DcpEntry:
    """A served tensor as a ``DcpEntry``: one range where it is one contiguous chunk, else assembled."""
    dtype, itemsize = TORCH_DTYPES[tensor.dtype]
    assert dtype is not None
    nbytes = itemsize
    for length in tensor.shape:
        nbytes *= length
    held = [chunk for chunk in tensor.chunks if chunk.volume]
    if not held:  # no element: nothing to read
        return DcpEntry(tensor.fqn, dtype, tensor.shape, 0, 0)
    stored = [found[(tensor.fqn, chunk.offsets)] for chunk in held]
    pieces = sorted(
        (
            piece(at.file, chunk.offsets, chunk.sizes, at.tensor, tensor.shape)
            for chunk, at in zip(held, stored, strict=True)
        ),
        key=lambda part: part.first,
    )
    first = pieces[0]
    if len(pieces) == 1 and first.tensor.contiguous:
        begin = first.tensor.offset
        return DcpEntry(tensor.fqn, dtype, tensor.shape, begin, begin + nbytes, first.file, None, 1)
    assembled = Assembled(tensor.shape, itemsize, tuple(pieces))
    begin = assembled.offset
    return DcpEntry(tensor.fqn, dtype, tensor.shape, begin, begin + nbytes, first.file, assembled, len(pieces))


def _metadata(metadata: Metadata, values: dict[str, BytesValue], path: str, warnings: list[str]) -> dict[str, str]:
    """``metadata/``: ``format`` ``pt`` (as a safetensors file from torch says), then each bytes entry's value."""
    shown = {"format": "pt"}
    for fqn in metadata.byte_entries:
        if fqn in shown or not encodable(fqn):
            warnings.append(f"{path}: bytes entry {fqn!r} is left out of metadata/: its name is taken or not UTF-8")
            continue
        shown[fqn] = values[fqn].text
    return shown


# The first bytes of a .metadata: a pickle (PROTO 2 to 5) whose first global is DCP's Metadata class.
_SIGNATURE = b"torch.distributed.checkpoint.metadata"


class _Dcp(Format):
    name = "dcp"
    title = "DCP .metadata"
    head_size = 64
    confirm_in_folder = True  # a folder's other .metadata files are not checkpoints

    def sniff(self, head: bytes) -> bool:
        """A pickle whose first global is DCP's ``Metadata`` (its module's name within the first bytes)."""
        return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5 and _SIGNATURE in head

    def read_header(
        self, fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0
    ) -> Header:
        folder: Folder | None = getattr(fetch, "folder", None)  # the files beside it, where the caller has them
        return fetch_header(
            fetch, path=path, file_size=file_size, mtime_ns=mtime_ns, first_read=first_read, folder=folder
        )

    def safetensors_name(self, path: str) -> str | None:
        """``FOLDER/.metadata`` -> ``FOLDER/model.safetensors``: the checkpoint as one safetensors file."""
        folder = path.rpartition("/")[0]
        return f"{folder}/model.safetensors" if folder else "model.safetensors"


FORMAT: Format = _Dcp()
