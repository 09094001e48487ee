"""GGUF's types: the ``gguf`` package's type table and value types, and what a parsed header holds."""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import struct
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Union, overload

import numpy as np


def _gguf_constants() -> ModuleType:
    """The ``gguf`` package's ``constants`` module: its type table and value types. ``import gguf.constants``
    runs the package's ``__init__`` first, which imports its reader, writer, quants and yaml, ~40 ms of every
    GGUF mount's start for these tables; the module imports nothing of the package, so its file runs alone. Where
    the package is imported already, or the file does not run alone (another version), the package's module."""
    if "gguf.constants" in sys.modules:
        return sys.modules["gguf.constants"]
    try:
        package = importlib.util.find_spec("gguf")
        assert package is not None and package.submodule_search_locations
        name = f"{__name__}._gguf_constants"
        path = os.path.join(next(iter(package.submodule_search_locations)), "constants.py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    except Exception:  # any failure: the ordinary import, which says what is wrong
        sys.modules.pop(f"{__name__}._gguf_constants", None)
        import gguf.constants

        return gguf.constants


if TYPE_CHECKING:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
else:
    _constants = _gguf_constants()
    GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType = (
        _constants.GGML_QUANT_SIZES,
        _constants.GGMLQuantizationType,
        _constants.GGUFValueType,
    )

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_STRING_LENGTH = 1 << 30  # GGUF_MAX_STRING_LENGTH
MAX_ARRAY_ELEMENTS = 1 << 30  # GGUF_MAX_ARRAY_ELEMENTS
MAX_NAME = 64  # GGML_MAX_NAME, the NUL included: a name has at most 63 bytes
MAX_DIMS = 4  # GGML_MAX_DIMS
INT64_MAX = 2**63 - 1
SIZE_MAX = 2**64 - 1
FIRST_READ = 2 << 20  # the first request; each later one at most doubles what was read, plus this
LOCAL_FIRST_READ = 16 << 20  # where reads are cheap: most vocabularies' headers, parsed once
CHEAP_BELOW = 64 << 10  # a source whose first read of a header asks for less reads cheaply (ByteSource.first_read)
ALIGNMENT_KEY = "general.alignment"

# The least bytes each thing can take, for the bounds on what the bytes left can hold.
_MIN_KV = 8 + 1 + 4 + 1  # a one-byte key, its type, a one-byte value
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # an empty name, n_dims 0, the type, the offset

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")

# GGUF's value types (gguf_type): the scalar ones' sizes and numpy dtypes. 8 (string) and 9 (array) are not scalars.
_SCALARS: Mapping[int, tuple[str, int]] = {
    GGUFValueType.UINT8: ("<u1", 1),
    GGUFValueType.INT8: ("<i1", 1),
    GGUFValueType.UINT16: ("<u2", 2),
    GGUFValueType.INT16: ("<i2", 2),
    GGUFValueType.UINT32: ("<u4", 4),
    GGUFValueType.INT32: ("<i4", 4),
    GGUFValueType.FLOAT32: ("<f4", 4),
    GGUFValueType.BOOL: ("<u1", 1),
    GGUFValueType.UINT64: ("<u8", 8),
    GGUFValueType.INT64: ("<i8", 8),
    GGUFValueType.FLOAT64: ("<f8", 8),
}
# As llama.cpp's GGUF_TYPE_NAME spells them, for messages and ``KeyValue.type_name``.
_VALUE_TYPE_NAMES: Mapping[int, str] = dict(
    enumerate(("u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "str", "arr", "u64", "i64", "f64"))
)

# GGML types whose stored bytes numpy reads as they are (GGUFReader's ``data`` dtypes for them).
_NUMPY_DTYPES: Mapping[str, str] = {
    "F32": "<f4",
    "F16": "<f2",
    "F64": "<f8",
    "I8": "<i1",
    "I16": "<i2",
    "I32": "<i4",
    "I64": "<i8",
}


class StringArray(Sequence[str]):
    """An array of strings (a vocabulary's) decoded when first asked for: a mount needs only its JSON. Equal to
    a list of the same strings."""

    __slots__ = ("_joined", "_count", "_items")

    def __init__(self, joined: bytes, count: int) -> None:
        self._joined = joined  # each string after 0xFF 0xFF 0xFF, bytes none of them holds
        self._count = count
        self._items: list[str] | None = None

    def _decoded(self) -> list[str]:
        if self._items is None:
            self._items = self._joined.decode("utf-8", "surrogateescape").split("\udcff\udcff\udcff")[1:]
        return self._items

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        return self._decoded()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._decoded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray | list):
            return self._decoded() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._decoded())


KvValue = Union[int, float, bool, str, np.ndarray, list[str], StringArray]  # noqa: UP007 (a runtime alias, py3.10)


@dataclass(frozen=True, slots=True)
class GgmlType:
    """A GGML tensor type as the ``gguf`` package knows it: ``block_size`` elements take ``type_size`` bytes."""

    id: int
    name: str  # as gguf-py spells it: F32, Q4_K, IQ2_XXS
    block_size: int
    type_size: int
    numpy_dtype: str | None  # the dtype numpy reads the stored bytes as (F32, F16, F64, I8-I64); None otherwise

    def nbytes(self, elements: int) -> int:
        """Bytes of ``elements`` values (a multiple of ``block_size``)."""
        return elements // self.block_size * self.type_size

    @property
    def dequantizable(self) -> bool:
        """Whether ``gguf.quants.dequantize`` decodes this type to float32."""
        return _dequantizable(self.id)


GGML_TYPES: Mapping[int, GgmlType] = {
    int(t): GgmlType(int(t), t.name, *GGML_QUANT_SIZES[t], _NUMPY_DTYPES.get(t.name))
    for t in GGMLQuantizationType
    if t in GGML_QUANT_SIZES
}
_TYPES_BY_NAME: Mapping[str, GgmlType] = {t.name: t for t in GGML_TYPES.values()}


def ggml_type(key: int | str) -> GgmlType:
    """The GGML type of id or name ``key`` (``12`` or ``"Q4_K"``); ``KeyError`` for one gguf does not know."""
    found = GGML_TYPES.get(key) if isinstance(key, int) else _TYPES_BY_NAME.get(key)
    if found is None:
        raise KeyError(key)
    return found


@functools.cache
def _dequantizable(type_id: int) -> bool:
    # Asked of the package itself, on one block of zeros: its list of decoders is private and changes by version.
    from gguf import quants
    from gguf.constants import GGMLQuantizationType as PackageType

    kind = GGML_TYPES[type_id]
    try:
        out = quants.dequantize(np.zeros((1, kind.type_size), dtype=np.uint8), PackageType(type_id))
    except NotImplementedError:
        return False
    return bool(out.dtype == np.float32 and out.size == kind.block_size)


@dataclass(frozen=True, slots=True, eq=False)
class KeyValue:
    """One key/value pair. ``type`` is GGUF's value type (0-12); an array has ``type`` 9 and its ``item_type``.

    Values: ints exact, bools, floats (a float32's exact value as a Python float), strings (bytes that are not
    UTF-8 kept as surrogate escapes, ``os.fsdecode``'s convention); arrays of numbers or bools as numpy arrays,
    arrays of strings as lists.
    """

    key: str
    type: int
    value: KvValue
    item_type: int | None = None
    # Where reading made them (an array of strings): ``value_json``, and the same as ``encoded_json`` makes it.
    text: str | None = field(default=None, repr=False)
    encoded: bytes | None = field(default=None, repr=False)

    @property
    def type_name(self) -> str:
        """``u32``, ``str``, ``f32``, ... and ``arr[str]`` for an array."""
        if self.item_type is None:
            return _VALUE_TYPE_NAMES[self.type]
        return f"arr[{_VALUE_TYPE_NAMES[self.item_type]}]"


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One tensor: ``shape`` in C order (GGUF's dimensions reversed); ``offset`` relative to the data section."""

    name: str
    type: GgmlType
    dims: tuple[int, ...]  # as stored, fastest-varying first (ggml's ne)
    offset: int
    nbytes: int
    file_offset: int  # absolute: the data section's start + offset

    @property
    def dtype(self) -> str:
        return self.type.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.dims[::-1]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)


@dataclass(frozen=True, slots=True, eq=False)
class GgufHeader:
    """A validated GGUF header of the ``file_size``-byte file ``path``."""

    path: str
    version: int
    file_size: int
    alignment: int
    header_size: int  # bytes from the magic to the end of the tensor infos
    data_offset: int  # where the data section starts: header_size padded to the alignment (if there are tensors)
    metadata: Mapping[str, KeyValue]  # in file order
    tensors: tuple[GgufTensor, ...]  # in file order

    @property
    def data_size(self) -> int:
        """Bytes of the data section up to the end of the last tensor."""
        return max((t.offset + t.nbytes for t in self.tensors), default=0)


class HeaderIncomplete(Exception):
    """The prefix given to ``parse_header`` ends inside the header, which needs at least ``need`` bytes."""

    def __init__(self, need: int) -> None:
        super().__init__(f"the header needs at least {need} bytes")
        self.need = need


@dataclass(frozen=True, slots=True, eq=False)
class GgufSplitSet:
    """A ``gguf-split`` set as one model: ``tensors`` pairs each tensor with the name of the split holding it."""

    name: str  # the prefix: x for x-00001-of-00003.gguf
    files: tuple[str, ...]  # the splits' names, in order
    headers: tuple[GgufHeader, ...]
    tensors: tuple[tuple[str, GgufTensor], ...]
    metadata: Mapping[str, KeyValue]  # every split's key/values, the first split's winning on a key
