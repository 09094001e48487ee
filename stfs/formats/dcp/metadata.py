"""A DCP's ``.metadata``: the pickle of a ``Metadata`` that torch's ``FileSystemWriter`` writes with ``pickle.dump``,
interpreted by the PyTorch reader's interpreter (nothing named is imported or called) into records, every member
checked as torch's dataclasses hold it: each fully qualified name's ``TensorStorageMetadata`` (its properties, size
and chunks) or ``BytesStorageMetadata``, and ``storage_data``, each chunk's ``MetadataIndex`` -> ``_StorageInfo``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..base import RangeFetcher
from ..pytorch.allowed import DCP_GLOBALS, TORCH_DTYPES
from ..pytorch.unpickler import WINDOW, Interpreter, Stream
from ..pytorch.values import Global, Key, Object, describe
from .rules import ChunkOutsideTensor, InvalidDcpMetadata, NotDcpMetadata, StorageOutsideFolder

MAX_DIMENSIONS = 64  # a tensor's, as the PyTorch reader's shapes
_MODULE = "torch.distributed.checkpoint.metadata"
_STORAGE_INFO = "torch.distributed.checkpoint.filesystem._StorageInfo"


@dataclass(frozen=True, slots=True)
class Chunk:
    """A ``ChunkStorageMetadata``: where a chunk lies in its tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def volume(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, slots=True)
class Stored:
    """A ``_StorageInfo``: where a chunk's (or a bytes entry's) ``torch.save`` lies; ``transforms`` its
    ``transform_descriptors`` (none: the bytes as written)."""

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """A ``TensorStorageMetadata``: a tensor's dtype (torch's name), size, chunks; ``left_out``: why stfs does not
    serve it, where it does not."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    left_out: str | None = None


@dataclass(frozen=True, slots=True)
class Metadata:
    """What a ``.metadata`` says: its tensors and bytes entries in its order, where each chunk lies (by fully
    qualified name and the chunk's offsets; a bytes entry's ``None``), the format's version, and the globals its
    pickle names outside those torch's DCP writes."""

    tensors: tuple[TensorMeta, ...]
    byte_entries: tuple[str, ...]
    storage: Mapping[tuple[str, tuple[int, ...] | None], Stored]
    version: str | None
    unknown_globals: tuple[str, ...]


def read_metadata(fetch: RangeFetcher, path: str, file_size: int) -> Metadata:
    """Interpret and check the ``.metadata`` of ``file_size`` bytes behind ``fetch``."""
    interpreter = Interpreter(path)
    top = interpreter.run(Stream(fetch, path, 0, file_size, min(file_size, WINDOW)))
    reader = _Reader(path)
    members = reader.members(top, "Metadata", "its pickle", refutes=True)
    storage = reader.storage(members.get("storage_data"))
    entries = members.get("state_dict_metadata")
    if type(entries) is not dict:
        raise InvalidDcpMetadata(path, f"its state_dict_metadata is {describe(entries)}, not a dict")
    tensors: list[TensorMeta] = []
    byte_entries: list[str] = []
    for fqn, entry in entries.items():
        if type(fqn) is not str:
            raise InvalidDcpMetadata(path, f"state_dict_metadata has the key {describe(fqn)}, not a name")
        if _class_of(entry) == f"{_MODULE}.BytesStorageMetadata":
            byte_entries.append(fqn)
        else:
            tensors.append(reader.tensor(fqn, entry))
    version = members.get("version")
    return Metadata(
        tensors=tuple(tensors),
        byte_entries=tuple(byte_entries),
        storage=storage,
        version=version if type(version) is str else None,
        unknown_globals=tuple(name for name in interpreter.globals if name not in DCP_GLOBALS),
    )


def _class_of(value: Any) -> str | None:
    """The class an object of the pickle was made of (``NEWOBJ``), by name."""
    if isinstance(value, Object) and isinstance(value.callee, Global):
        return value.callee.full
    return None


class _Reader:
    """The members of the dataclasses torch pickles, checked as each is read."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, detail: str, tensor: str | None = None) -> InvalidDcpMetadata:
        return InvalidDcpMetadata(self.path, detail, tensor)

    def members(self, value: Any, name: str, what: str, refutes: bool = False, tensor: str | None = None) -> Any:
        """The state (``__dict__``, or what its ``__getstate__`` gave) of ``value``, an object of ``name``."""
        full = name if "." in name else f"{_MODULE}.{name}"
        if _class_of(value) != full:
            detail = f"{what} is {describe(value)}, not a {full}"
            if refutes:
                raise NotDcpMetadata(self.path, detail)
            raise self.fail(detail, tensor)
        state = value.state
        if state is None:
            return {}
        if type(state) is not dict and not (name == "TensorProperties" and type(state) is tuple):
            raise self.fail(f"{what}'s state is {describe(state)}, not its fields", tensor)
        return state

    def sizes(self, value: Any, what: str, tensor: str | None) -> tuple[int, ...]:
        """A ``torch.Size`` (which the interpreter makes a tuple) of non-negative integers."""
        if type(value) not in (tuple, list) or len(value) > MAX_DIMENSIONS:
            raise self.fail(f"its {what} is {describe(value)}, not a torch.Size", tensor)
        if not all(type(n) is int and 0 <= n < 2**63 for n in value):
            raise self.fail(f"its {what} {describe(value)} holds other than non-negative integers", tensor)
        return tuple(value)

    def tensor(self, fqn: str, value: Any) -> TensorMeta:
        members = self.members(value, "TensorStorageMetadata", "its storage metadata", tensor=fqn)
        properties = self.members(members.get("properties"), "TensorProperties", "its properties", tensor=fqn)
        if type(properties) is tuple:  # TensorProperties.__getstate__: (dtype, layout, requires_grad, ...)
            dtype, layout = (properties + (None, None))[:2]
        else:
            dtype, layout = properties.get("dtype"), properties.get("layout")
        if not (isinstance(dtype, Global) and dtype.module == "torch"):
            raise self.fail(f"its dtype is {describe(dtype)}, not a torch dtype", fqn)
        shape = self.sizes(members.get("size"), "size", fqn)
        chunks = members.get("chunks")
        if type(chunks) is not list:
            raise self.fail(f"its chunks are {describe(chunks)}, not a list", fqn)
        found = []
        for chunk in chunks:
            fields = self.members(chunk, "ChunkStorageMetadata", "a chunk", tensor=fqn)
            offsets = self.sizes(fields.get("offsets"), "chunk's offsets", fqn)
            sizes = self.sizes(fields.get("sizes"), "chunk's sizes", fqn)
            if (
                len(offsets) != len(shape)
                or len(sizes) != len(shape)
                or any(start + size > whole for start, size, whole in zip(offsets, sizes, shape, strict=True))
            ):
                raise ChunkOutsideTensor(
                    self.path, f"a chunk at offsets {list(offsets)} of sizes {list(sizes)} of size {list(shape)}", fqn
                )
            found.append(Chunk(offsets, sizes))
        left_out = None
        if dtype.name not in TORCH_DTYPES:
            left_out = f"dtype torch.{dtype.name}, which stfs does not know"
        elif TORCH_DTYPES[dtype.name][0] is None:
            left_out = f"dtype torch.{dtype.name}, which safetensors does not have"
        elif layout is not None and not _strided(layout):
            left_out = f"layout {describe(layout)}: its chunks are not dense"
        return TensorMeta(fqn, dtype.name, shape, tuple(found), left_out)

    def storage(self, value: Any) -> dict[tuple[str, tuple[int, ...] | None], Stored]:
        """``storage_data``: each ``MetadataIndex`` (a fully qualified name, a chunk's offsets) -> its storage."""
        if type(value) is not dict:
            raise self.fail(f"its storage_data is {describe(value)}, not a dict")
        found: dict[tuple[str, tuple[int, ...] | None], Stored] = {}
        for key, info in value.items():
            index = self.members(key.value if type(key) is Key else key, "MetadataIndex", "a key of storage_data")
            fqn = index.get("fqn")
            if type(fqn) is not str:
                raise self.fail(f"a MetadataIndex's fqn is {describe(fqn)}, not a name")
            offset = index.get("offset")
            where = None if offset is None else self.sizes(offset, "MetadataIndex's offset", fqn)
            if _class_of(info) != _STORAGE_INFO:
                raise NotDcpMetadata(
                    self.path,
                    f"its storage_data holds {describe(info)}, not a {_STORAGE_INFO}: a checkpoint of another "
                    "storage writer than the .distcp files FileSystemWriter writes",
                )
            found[(fqn, where)] = self.stored(self.members(info, _STORAGE_INFO, "a storage"), fqn)
        return found

    def stored(self, fields: Any, fqn: str) -> Stored:
        file, offset, length = fields.get("relative_path"), fields.get("offset"), fields.get("length")
        if type(file) is not str:
            raise self.fail(f"its storage's relative_path is {describe(file)}, not a file name", fqn)
        if not all(type(n) is int and 0 <= n < 2**63 for n in (offset, length)):
            raise self.fail(f"its storage's offset {describe(offset)} and length {describe(length)}", fqn)
        if not file or "/" in file or "\\" in file or "\0" in file or file in (".", ".."):
            raise StorageOutsideFolder(
                self.path, f"relative_path {file!r} is not a file name of the checkpoint's folder", fqn
            )
        transforms = fields.get("transform_descriptors")
        if transforms is not None and type(transforms) not in (list, tuple):
            raise self.fail(f"its storage's transform_descriptors are {describe(transforms)}", fqn)
        return Stored(file, offset, length, tuple(str(t) for t in transforms or ()))


def _strided(layout: Any) -> bool:
    """Whether a pickled ``torch.layout`` (``torch.serialization._get_layout('torch.strided')``) is strided."""
    return (
        isinstance(layout, Object)
        and isinstance(layout.callee, Global)
        and layout.callee.full == "torch.serialization._get_layout"
        and layout.args == ("torch.strided",)
    )
