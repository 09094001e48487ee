"""GGUF, llama.cpp's model format: read a header through a range reader and enforce llama.cpp's rules (SPEC §11).

Pure: bytes come through ``read(offset, size)``, no I/O of its own. The checks run in the order llama.cpp's
``gguf_init_from_reader`` (``ggml/src/gguf.cpp``) reads the file, then the model loader's bound on each
tensor's bytes; each refusal is its own ``errors.GgufError`` naming the file, the tensor and the rule.

A GGUF header has no length prefix: ``parse_header`` takes a prefix of the file and raises ``HeaderIncomplete``
with a lower bound on the header's end when the prefix is too short; ``read_header`` grows the prefix so that
a remote header costs at most 4 requests and twice its bytes plus 2 MiB (for headers up to 30 MiB; more
only where the header is larger still), and never reaches past the bytes that bound needs.

Layout (v2 and v3): ``GGUF``, u32 version, u64 tensor count, u64 key/value count, the key/values, the tensor
infos, zero padding to the alignment, the data section. Strings are a u64 length and their bytes. The type
table (names, block sizes) is the ``gguf`` package's, never a copy of it.

A tensor with no dimensions (n_dims 0), which llama.cpp reads as one element, is refused as SPEC §11 says (1 to
4 dimensions). Where the SPEC is silent, as llama.cpp reads it: names are compared as C strings for duplicates
(``a\\0x`` and ``a\\0y`` are one name to ggml); a bool is true for any byte but 0. Names and strings that are not
UTF-8 keep their bytes as surrogate escapes (``os.fsdecode``'s convention): a ``metadata/`` string file holds the
bytes, JSON the ``\\udcXX`` escape. JSON has no NaN or infinity: those float values are the strings ``"NaN"``,
``"Infinity"``, ``"-Infinity"``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import os
import re
import struct
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Union, overload

import numpy as np

from .. import errors
from .base import DType, Format, Header, RangeFetcher, SplitSet, TensorEntry


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


def read_header(read: RangeFetcher, file_size: int, *, path: str, first_read: int = FIRST_READ) -> GgufHeader:
    """Read and validate the header of the ``file_size``-byte file ``path`` through ``read(offset, size)``.

    Reads grow: ``first_read`` bytes, then up to ``max(2 * read so far, 2 * the header's lower bound) + 2 MiB``
    in all, each request asking only for bytes not yet read. With the default ``first_read``, a header of H
    bytes costs at most 2 H + 2 MiB bytes, and at most 4 requests when H is at most 30 MiB. A local caller may
    pass a larger ``first_read`` (or the file size) to parse once.
    """
    have = b""
    want = min(file_size, max(first_read, 4))
    while True:
        if want > len(have):
            have += read(len(have), want - len(have))
            if len(have) < want:
                raise errors.GgufTruncated(
                    path, f"the file ended after {len(have)} bytes, short of the {file_size} its size says"
                )
        try:
            return parse_header(have, file_size=file_size, path=path)
        except HeaderIncomplete as more:
            want = min(file_size, max(2 * len(have), 2 * more.need) + FIRST_READ)


def parse_header(buf: bytes, *, file_size: int, path: str) -> GgufHeader:
    """Validate the header in ``buf``, the first bytes of the ``file_size``-byte file ``path``.

    Raises ``HeaderIncomplete`` when ``buf`` ends inside the header (and is shorter than the file), else the
    ``errors.GgufError`` of the first rule the file breaks, in llama.cpp's order.
    """
    return _Parser(buf, file_size, path).parse()


class _Parser:
    """One pass over a header prefix, as ``gguf_init_from_reader`` reads it."""

    def __init__(self, buf: bytes, file_size: int, path: str) -> None:
        self.buf = buf
        self.end = min(len(self.buf), file_size)
        self.file_size = file_size
        self.path = path
        self.pos = 0
        # What must still follow the current item, for the lower bound HeaderIncomplete reports.
        self.kv_left = 0
        self.tensors_left = 0
        self.items_left = 0  # of the array being read, at 8 bytes each at least

    # -- reading ---------------------------------------------------------------------------------------------

    def _rest(self) -> int:
        return self.kv_left * _MIN_KV + self.tensors_left * _MIN_TENSOR_INFO + self.items_left * 8

    def _need(self, size: int, what: str) -> None:
        """Make sure ``size`` bytes from ``pos`` are in the buffer; ``what`` names them if the file ends first."""
        stop = self.pos + size
        if stop <= self.end:
            return
        if stop > self.file_size:
            raise errors.GgufTruncated(
                self.path, f"the {self.file_size}-byte file ends inside {what} (at byte {self.pos}, {size} needed)"
            )
        raise HeaderIncomplete(stop + self._rest())

    def _int(self, codec: struct.Struct, what: str) -> int:
        """The integer ``codec`` reads at ``pos`` (``_U32``, ``_I32``, ``_U64``, ``_I64``)."""
        self._need(codec.size, what)
        (value,) = codec.unpack_from(self.buf, self.pos)
        self.pos += codec.size
        return int(value)

    def _string_length(self, what: str, tensor: str | None = None) -> int:
        length = self._int(_U64, f"the length of {what}")
        if length > MAX_STRING_LENGTH:
            raise errors.StringTooLong(self.path, f"{what} is {length} bytes, over the 1 GiB limit", tensor)
        if length > self.file_size - self.pos:
            raise errors.StringTooLong(
                self.path, f"{what} is {length} bytes, more than the {self.file_size - self.pos} left", tensor
            )
        return length

    def _string_bytes(self, what: str, tensor: str | None = None) -> bytes:
        length = self._string_length(what, tensor)
        self._need(length, what)
        raw = self.buf[self.pos : self.pos + length]
        self.pos += length
        return raw

    def _string(self, what: str) -> str:
        return self._string_bytes(what).decode("utf-8", "surrogateescape")

    # -- the header ------------------------------------------------------------------------------------------

    def parse(self) -> GgufHeader:
        path = self.path
        self._need(4, "the magic")
        magic = self.buf[:4]
        if magic != MAGIC:
            raise errors.InvalidMagic(path, f"the file starts with {magic!r}, not {MAGIC!r}")
        self.pos = 4
        version = self._version()
        n_tensors = self._int(_I64, "the tensor count")
        if n_tensors < 0:
            raise errors.InvalidCount(path, f"tensor count {n_tensors} is negative (as llama.cpp's i64)")
        n_kv = self._int(_I64, "the key/value count")
        if n_kv < 0:
            raise errors.InvalidCount(path, f"key/value count {n_kv} is negative (as llama.cpp's i64)")
        left = self.file_size - self.pos
        if n_kv * _MIN_KV > left:
            raise errors.InvalidCount(
                path, f"{n_kv} key/values need at least {n_kv * _MIN_KV} bytes, the file has {left} left"
            )
        if n_kv * _MIN_KV + n_tensors * _MIN_TENSOR_INFO > left:
            raise errors.InvalidCount(
                path,
                f"{n_tensors} tensor infos need at least {n_tensors * _MIN_TENSOR_INFO} bytes after the key/values, "
                f"the file has {left} left",
            )
        self.tensors_left = n_tensors
        metadata = self._key_values(n_kv)
        alignment = self._alignment(metadata)
        tensors_read = self._tensor_infos(n_tensors)
        header_size = self.pos
        data_offset = _pad(header_size, alignment) if n_tensors > 0 else header_size
        if data_offset > self.file_size:
            raise errors.DataSectionOutOfFile(
                path,
                f"the data section would start at byte {data_offset}, past the end of the {self.file_size}-byte file",
            )
        tensors = self._offsets(tensors_read, alignment, data_offset)
        return GgufHeader(path, version, self.file_size, alignment, header_size, data_offset, metadata, tensors)

    def _version(self) -> int:
        version = self._int(_U32, "the version")
        if version == 0:
            raise errors.UnsupportedVersion(self.path, "version 0 is not a GGUF version")
        if version & 0xFFFF == 0:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            raise errors.BigEndianFile(
                self.path, f"the version reads {version:#010x}: a big-endian file (version {swapped} byte-swapped)"
            )
        if version == 1:
            raise errors.ObsoleteVersion(self.path, "version 1 is obsolete (llama.cpp reads versions 2 and 3)")
        if version > 3:
            raise errors.UnsupportedVersion(self.path, f"version {version} is newer than 3, the latest llama.cpp reads")
        return version

    def _key_values(self, count: int) -> dict[str, KeyValue]:
        found: dict[str, KeyValue] = {}
        for i in range(count):
            self.kv_left = count - i - 1
            key = self._string(f"key {i}")
            if not key:
                raise errors.EmptyKey(self.path, f"key {i} is empty")
            if key in found:
                raise errors.DuplicateKvKey(self.path, f"key {key!r} appears twice (key {i})")
            kind = self._int(_I32, f"the type of key {key!r}")
            if kind == GGUFValueType.ARRAY:
                item = self._int(_I32, f"the element type of key {key!r}")
                length = self._int(_U64, f"the length of key {key!r}")
                value, made = self._array(key, item, length)
                found[key] = KeyValue(key, kind, value, item, *(made or (None, None)))
            else:
                found[key] = KeyValue(key, kind, self._scalar(key, kind))
        self.kv_left = 0
        return found

    def _scalar(self, key: str, kind: int) -> KvValue:
        if kind == GGUFValueType.STRING:
            return self._string(f"the value of key {key!r}")
        scalar = _SCALARS.get(kind)
        if scalar is None:
            raise errors.InvalidKvType(self.path, f"key {key!r} has type {kind}, not one of GGUF's 0-12")
        dtype, size = scalar
        self._need(size, f"the value of key {key!r}")
        value = np.frombuffer(self.buf, dtype=dtype, count=1, offset=self.pos)[0]
        self.pos += size
        if kind == GGUFValueType.BOOL:
            return bool(value != 0)  # llama.cpp: any byte but 0 is true
        item: int | float = value.item()
        return item

    def _array(self, key: str, item: int, length: int) -> tuple[KvValue, tuple[str, bytes] | None]:
        """The array's values, and its JSON where reading it made that already (an array of strings)."""
        if item == GGUFValueType.ARRAY:
            raise errors.InvalidKvType(self.path, f"key {key!r} is an array of arrays, which llama.cpp does not read")
        if item != GGUFValueType.STRING and item not in _SCALARS:
            raise errors.InvalidKvType(self.path, f"key {key!r} is an array of type {item}, not one of GGUF's 0-12")
        if length > MAX_ARRAY_ELEMENTS:
            raise errors.ArrayTooLong(self.path, f"key {key!r} has {length} elements, over the limit of 2^30")
        item_size = 8 if item == GGUFValueType.STRING else _SCALARS[item][1]
        left = self.file_size - self.pos
        if length * item_size > left:
            raise errors.ArrayTooLong(
                self.path,
                f"key {key!r} has {length} elements of at least {item_size} bytes, more than the {left} bytes left",
            )
        if item == GGUFValueType.STRING:
            return self._strings(key, length)
        dtype, size = _SCALARS[item]
        self._need(length * size, f"the value of key {key!r}")
        values = np.frombuffer(self.buf, dtype=dtype, count=length, offset=self.pos).copy()
        self.pos += length * size
        if item == GGUFValueType.BOOL:
            return values != 0, None
        return values.astype(values.dtype.newbyteorder("="), copy=False), None

    def _strings(self, key: str, count: int) -> tuple[StringArray | list[str], tuple[str, bytes] | None]:
        """An array of ``count`` strings, and its JSON: a vocabulary, so the lengths are walked with numpy
        (``_walk``) and the strings decoded and their JSON made in a few passes over their bytes
        (``_string_array``); an element that breaks a rule, or lies past the prefix, is the checked loop's."""
        if count == 0:
            return [], ("[]", b"[]")
        starts, pos = _walk(self.buf, self.pos, count, self.end)
        if len(starts) < count:  # the element at pos breaks a rule or is not all in the prefix: the loop says which
            self._strings_checked(key, count, len(starts), pos)
            return self._strings_checked(key, count, 0, self.pos), None  # not reached: the checked loop refuses
        self.pos = pos
        return _string_array(self.buf, starts, pos)

    def _strings_checked(self, key: str, count: int, first: int, pos: int) -> list[str]:
        """Elements ``first``.. of a string array from ``pos``, every rule checked as llama.cpp reads them."""
        buf, end, file_size, unpack = self.buf, self.end, self.file_size, _U64.unpack_from
        out: list[str] = []
        append = out.append
        for j in range(first, count):
            if pos + 8 > end:
                self.pos, self.items_left = pos, count - j - 1
                self._need(8, f"the length of element {j} of key {key!r}")
            (length,) = unpack(buf, pos)
            pos += 8
            if length > MAX_STRING_LENGTH or length > file_size - pos:
                self.pos = pos - 8
                self._string_length(f"element {j} of key {key!r}")
            if pos + length > end:
                self.pos, self.items_left = pos, count - j - 1
                self._need(length, f"element {j} of key {key!r}")
            append(buf[pos : pos + length].decode("utf-8", "surrogateescape"))
            pos += length
        self.pos, self.items_left = pos, 0
        return out

    def _alignment(self, metadata: Mapping[str, KeyValue]) -> int:
        found = metadata.get(ALIGNMENT_KEY)
        if found is None:
            return DEFAULT_ALIGNMENT
        if found.type != GGUFValueType.UINT32:
            raise errors.InvalidAlignment(self.path, f"{ALIGNMENT_KEY!r} is of type {found.type_name}, not u32")
        alignment = found.value
        assert isinstance(alignment, int)
        if alignment == 0 or alignment & (alignment - 1):
            raise errors.InvalidAlignment(self.path, f"{ALIGNMENT_KEY!r} is {alignment}, not a power of two")
        return alignment

    def _tensor_infos(self, count: int) -> list[tuple[str, GgmlType, tuple[int, ...], int]]:
        infos: list[tuple[str, GgmlType, tuple[int, ...], int]] = []
        seen: set[bytes] = set()
        for i in range(count):
            self.tensors_left = count - i - 1
            raw = self._string_bytes(f"the name of tensor {i}")
            name = raw.decode("utf-8", "surrogateescape")
            if len(raw) >= MAX_NAME:
                raise errors.TensorNameTooLong(self.path, f"the name is {len(raw)} bytes, not under {MAX_NAME}", name)
            c_name = raw.split(b"\0", 1)[0]  # ggml keeps a name as a C string
            if c_name in seen:
                raise errors.DuplicateTensorName(self.path, f"tensor {i} repeats the name of an earlier one", name)
            seen.add(c_name)
            n_dims = self._int(_U32, f"the dimension count of tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:  # llama.cpp refuses more than 4; SPEC §11 a tensor without any too
                raise errors.InvalidDimensions(self.path, f"{n_dims} dimensions, not 1 to {MAX_DIMS}", name)
            dims: tuple[int, ...] = ()
            for j in range(n_dims):
                extent = self._int(_I64, f"dimension {j} of tensor {name!r}")
                if extent < 0:
                    raise errors.InvalidDimensions(self.path, f"dimension {j} is {extent}, negative", name)
                dims += (extent,)
            ne = dims + (1,) * (MAX_DIMS - n_dims)
            if math.prod(ne) > 0 and (
                INT64_MAX // ne[1] <= ne[0]
                or INT64_MAX // ne[2] <= ne[0] * ne[1]
                or INT64_MAX // ne[3] <= ne[0] * ne[1] * ne[2]
            ):
                raise errors.GgufOverflow(self.path, f"dimensions {list(dims)} hold 2^63 - 1 elements or more", name)
            type_id = self._int(_I32, f"the type of tensor {name!r}")
            kind = GGML_TYPES.get(type_id)
            if kind is None:
                raise errors.UnknownGgmlType(self.path, f"type {type_id} is not a GGML type gguf 0.19 knows", name)
            if ne[0] % kind.block_size:
                raise errors.RowNotBlockMultiple(
                    self.path,
                    f"its first dimension {ne[0]} is not a multiple of {kind.name}'s block of {kind.block_size}",
                    name,
                )
            elements = math.prod(ne)
            if elements // kind.block_size > SIZE_MAX // kind.type_size:
                raise errors.GgufOverflow(self.path, f"{elements} {kind.name} elements take 2^64 bytes or more", name)
            offset = self._int(_U64, f"the offset of tensor {name!r}")
            infos.append((name, kind, dims, offset))
        self.tensors_left = 0
        return infos

    def _offsets(
        self, infos: list[tuple[str, GgmlType, tuple[int, ...], int]], alignment: int, data_offset: int
    ) -> tuple[GgufTensor, ...]:
        tensors: list[GgufTensor] = []
        expected = 0
        for name, kind, dims, offset in infos:
            if offset != expected:
                raise errors.TensorOffsetMismatch(
                    self.path,
                    f"offset {offset}, where the padded sizes of the tensors before it add up to {expected}",
                    name,
                )
            nbytes = kind.nbytes(math.prod(dims))
            padded = _pad(nbytes, alignment)
            if expected + padded > SIZE_MAX:
                raise errors.GgufOverflow(self.path, f"the data section's size passes 2^64 at {nbytes} bytes", name)
            expected += padded
            tensors.append(GgufTensor(name, kind, dims, offset, nbytes, data_offset + offset))
        # llama.cpp's model loader: every tensor's bytes inside the file.
        for tensor in tensors:
            stop = tensor.file_offset + tensor.nbytes
            if stop > self.file_size:
                raise errors.TensorOutOfFile(
                    self.path,
                    f"its bytes {tensor.file_offset}-{stop} run past the end of the {self.file_size}-byte file",
                    tensor.name,
                )
        return tuple(tensors)


_WALK_STRETCH = 4 << 20  # bytes looked at in one pass (a stretch of zeros makes a candidate of every byte)


def _walk(buf: bytes, pos: int, count: int, end: int) -> tuple[np.ndarray, int]:
    """Where each of ``count`` strings (a u64 length, then its bytes) from ``pos`` starts, and where the last one
    ends; fewer starts where the next string (at the position returned) is over 1 GiB or runs past ``end``.

    A length under 256 is a word whose bytes 1-7 are 0: such words, found in one pass over a stretch of the
    bytes, are the candidates, and from a known start, each candidate that ends where the next one starts
    makes the next one a start too, so a run of them is taken at once. A start that is no candidate (a string
    of 256 bytes or more) is stepped over alone; past a few steps per string, the rest are (an odd array)."""
    found: list[np.ndarray] = []
    taken = steps = 0
    began = pos
    per = 24  # bytes a string takes with its length, until some are read
    while taken < count and pos + 8 <= end and steps < 64 + taken // 8:
        size = min(end - pos, (count - taken) * per + 4096, _WALK_STRETCH)
        words = np.ndarray((size - 7,), dtype="<u8", buffer=buf, offset=pos, strides=(1,))
        candidates = np.flatnonzero(words < 256)
        after = candidates + 8 + words[candidates].astype(np.int64)
        breaks = np.flatnonzero(after[:-1] != candidates[1:])  # where a run of candidates may not go on
        at = 0
        while taken < count and at + 8 <= size and steps < 64 + taken // 8:
            steps += 1
            first = int(np.searchsorted(candidates, at))
            if first < len(candidates) and candidates[first] == at:
                stop = int(np.searchsorted(breaks, first))
                last = min(int(breaks[stop]) if stop < len(breaks) else len(candidates) - 1, first + count - taken - 1)
                found.append(candidates[first : last + 1] + pos)
                taken += last + 1 - first
                at = int(after[last])
                continue
            (length,) = _U64.unpack_from(buf, pos + at)
            if length > MAX_STRING_LENGTH or pos + at + 8 + length > end:
                return _concatenated(found), pos + at
            found.append(np.array([pos + at], dtype=np.int64))
            taken += 1
            at += 8 + length
        pos += at
        per = (pos - began) // max(taken, 1) + 1
    if taken < count and steps >= 64 + taken // 8:  # many breaks: one string at a time
        rest: list[int] = []
        mark, unpack = rest.append, _U64.unpack_from
        for _ in range(count - taken):
            if pos + 8 > end:
                break
            (length,) = unpack(buf, pos)
            if length > MAX_STRING_LENGTH or pos + 8 + length > end:
                break
            mark(pos)
            pos += 8 + length
        found.append(np.array(rest, dtype=np.int64))
    starts = _concatenated(found)
    if pos > end:  # the last string runs past the end
        return starts[:-1], int(starts[-1])
    return starts, pos


def _concatenated(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)


# JSON's escape of each byte that json.dumps escapes in a string (ensure_ascii=False): a quote, a backslash, and
# the bytes under 0x20. A byte is replaced by the last byte of its escape, and the others are put before it.
_ESCAPES = {b: e for b in range(0x80) if (e := json.dumps(chr(b), ensure_ascii=False)[1:-1].encode()) != bytes([b])}
assert set(_ESCAPES) == {*range(0x20), ord('"'), ord("\\")}  # what _string_array looks for
_ESCAPE_GROWS = np.zeros(256, dtype=np.uint8)  # how many bytes go before the byte: 0 for one not escaped
_ESCAPE_HEADS = np.zeros((256, 5), dtype=np.uint8)
_ESCAPE_LAST = np.arange(256, dtype=np.uint8)
for _byte, _escape in _ESCAPES.items():
    _ESCAPE_GROWS[_byte] = len(_escape) - 1
    _ESCAPE_HEADS[_byte, : len(_escape) - 1] = np.frombuffer(_escape[:-1], dtype=np.uint8)
    _ESCAPE_LAST[_byte] = _escape[-1]
_QUOTE, _COMMA, _BACKSLASH = ord('"'), ord(","), ord("\\")


def _string_array(
    buf: bytes, starts: np.ndarray, stop: int
) -> tuple[StringArray | list[str], tuple[str, bytes] | None]:
    """The strings whose u64 lengths sit at ``starts`` (back to back, the last ending at ``stop``), decoded as
    UTF-8 (surrogate escapes for other bytes), and their JSON as ``json.dumps(..., ensure_ascii=False)`` makes it
    (``None`` where a string is not UTF-8: that JSON is json's to make), in a few passes over the bytes.

    Each length's first 5 bytes go, its last 3 make room for a separator: ``\\xff\\xff\\xff`` (bytes UTF-8 never
    holds) to split the decoded text at, then ``","`` between the strings of the JSON, whose escapes are put in
    with one insert."""
    count = len(starts)
    base = int(starts[0])
    region = np.frombuffer(buf, dtype=np.uint8, count=stop - base, offset=base)
    local = starts - base
    keep = np.ones(len(region), dtype=bool)
    for k in range(5):
        keep[local + k] = False
    joined = region[keep]
    room = local - 5 * np.arange(count)  # each separator's first byte in joined: 5 bytes of each length gone
    for k in range(3):
        joined[room + k] = 0xFF
    values: StringArray | list[str]
    if np.count_nonzero(joined == 0xFF) == 3 * count:  # no string holds 0xFF: the text splits where they were
        values = StringArray(joined.tobytes(), count)
    else:
        ends = [*starts[1:].tolist(), stop]
        values = [buf[s + 8 : e].decode("utf-8", "surrogateescape") for s, e in zip(starts.tolist(), ends, strict=True)]
    for k in range(3):
        joined[room + k] = _COMMA  # a byte JSON does not escape, for now
    escaped = np.flatnonzero((joined < 0x20) | (joined == _QUOTE) | (joined == _BACKSLASH))
    if len(escaped):
        codes = joined[escaped]
        sizes = _ESCAPE_GROWS[codes].astype(np.int64)
        total = np.cumsum(sizes)
        heads = _ESCAPE_HEADS[np.repeat(codes, sizes), np.arange(int(total[-1])) - np.repeat(total - sizes, sizes)]
        joined[escaped] = _ESCAPE_LAST[codes]
        joined = np.insert(joined, np.repeat(escaped, sizes), heads)
        room += np.concatenate(([0], total))[np.searchsorted(escaped, room)]
    joined[room] = _QUOTE
    joined[room + 1] = _COMMA
    joined[room + 2] = _QUOTE
    joined[1] = ord("[")
    encoded = joined[1:].tobytes() + b'"]'
    try:
        return values, (encoded.decode("utf-8"), encoded)
    except UnicodeDecodeError:
        return values, None


def _pad(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


# -- safetensors-schema JSON -------------------------------------------------------------------------------------

_NON_FINITE = {"nan": '"NaN"', "inf": '"Infinity"', "-inf": '"-Infinity"'}


def _float64_texts(values: np.ndarray) -> list[str]:
    """Shortest round-trip decimals of float64 values (Python's repr); NaN and the infinities as JSON strings."""
    listed = values.astype(np.float64).tolist()
    if np.isfinite(values).all():
        return json.dumps(listed)[1:-1].split(", ") if listed else []
    return [repr(v) if math.isfinite(v) else _NON_FINITE[repr(v)] for v in listed]


def _float32_texts(values: np.ndarray) -> list[str]:
    """The shortest decimal that reads back as the same float32, each value: numpy's Dragon4 for float32
    (``1e-05`` for 1e-5, where a float64's repr gives 9.999999747378752e-06); NaN and the infinities as JSON
    strings."""
    texts: list[str] = np.asarray(values, dtype=np.float32).astype(str).tolist()
    if not np.isfinite(values).all():
        texts = [_NON_FINITE.get(t, t) for t in texts]
    return texts


_POWERS_OF_10 = 10 ** np.arange(20, dtype=np.uint64)


def _whole_numbers_json(values: np.ndarray, suffix: bytes = b"") -> str:
    """The JSON array of ``values``, integers (or whole floats, ``suffix`` ``.0``, their signs as signbit says)
    as ``json.dumps`` writes them, made digit by digit for all of them at once: no Python int for each."""
    if values.dtype.kind == "f":
        negative = np.signbit(values)
        magnitude = np.abs(values).astype(np.uint64)
    elif values.dtype.kind == "u":
        negative = np.zeros(len(values), dtype=bool)
        magnitude = values.astype(np.uint64)
    else:
        negative = values < 0
        magnitude = np.abs(values.astype(np.int64)).astype(np.uint64)  # -2^63 wraps to 2^63, its magnitude
    digits = np.searchsorted(_POWERS_OF_10, magnitude, side="right").astype(np.int64)
    np.maximum(digits, 1, out=digits)  # 0 has one
    width = negative + digits + len(suffix) + 1  # and a comma
    ends = np.cumsum(width)
    out = np.empty(1 + int(ends[-1]), dtype=np.uint8)
    out[0] = ord("[")
    begins = ends - width + 1
    out[begins[negative]] = ord("-")
    place = begins + negative + digits - 1  # the last digit's
    for k, byte in enumerate(suffix):
        out[place + 1 + k] = byte
    out[ends] = ord(",")
    out[-1] = ord("]")
    rest = magnitude
    for k in range(int(digits.max())):
        going = digits > k
        out[place[going] - k] = ord("0") + (rest[going] % 10).astype(np.uint8)
        rest = rest // 10
    return out.tobytes().decode("ascii")


def _scalar_json(kind: int, value: Any) -> str:
    if kind == GGUFValueType.STRING:
        return json.dumps(value, ensure_ascii=False)
    if kind == GGUFValueType.BOOL:
        return "true" if value else "false"
    if kind == GGUFValueType.FLOAT32:
        return _float32_texts(np.array([value], dtype=np.float32))[0]
    if kind == GGUFValueType.FLOAT64:
        return _float64_texts(np.array([value], dtype=np.float64))[0]
    return str(int(value))


def value_json(kv: KeyValue) -> str:
    """The JSON text of a key/value's value: ints exact, floats shortest for their type, NaN as ``"NaN"``."""
    if kv.text is not None:
        return kv.text
    if kv.item_type is None:
        return _scalar_json(kv.type, kv.value)
    value = kv.value
    if kv.item_type == GGUFValueType.STRING:
        assert isinstance(value, StringArray | list)
        return json.dumps(list(value), ensure_ascii=False, separators=(",", ":"))
    assert isinstance(value, np.ndarray)
    if kv.item_type == GGUFValueType.FLOAT32:
        if len(value) and (np.abs(value) < 10**6).all() and (value == value.round()).all():
            # whole numbers under a million (a vocabulary's scores): a float32 holds each exactly and no shorter
            # decimal reads back as it, so numpy writes its digits and ".0" (-5.0; 1e+06 from a million on)
            return _whole_numbers_json(value, b".0")
        return "[" + ",".join(_float32_texts(value)) + "]"
    if kv.item_type == GGUFValueType.FLOAT64:
        return "[" + ",".join(_float64_texts(value)) + "]"
    if value.dtype == np.bool_ or not len(value):
        return json.dumps(value.tolist(), separators=(",", ":"))  # true/false
    return _whole_numbers_json(value)  # exact


def metadata_file(kv: KeyValue) -> bytes:
    """The content of ``metadata/KEY``: a string as it is, anything else as its JSON; then a newline."""
    if kv.type == GGUFValueType.STRING:
        assert isinstance(kv.value, str)
        return kv.value.encode("utf-8", "surrogateescape") + b"\n"  # its bytes as stored
    return encoded_json(kv) + b"\n"


def _json_bytes(text: str) -> bytes:
    # A surrogate escape (a byte that was not UTF-8) can only stand inside a JSON string, where \udcXX is its
    # escape: the text stays UTF-8 and valid JSON.
    return text.encode("utf-8", "backslashreplace")


def encoded_json(kv: KeyValue) -> bytes:
    """``value_json`` as UTF-8 bytes (a surrogate escape as its JSON escape, ``\\udcff``)."""
    return kv.encoded if kv.encoded is not None else _json_bytes(value_json(kv))


def header_json(model: GgufHeader | GgufSplitSet, encoded: Mapping[str, bytes] | None = None) -> bytes:
    """``header.json`` in the safetensors schema (SPEC §11): ``__metadata__`` with every key/value, then each
    tensor's ``dtype``, C-order ``shape`` and ``data_offsets`` relative to its file's data section; a split set
    adds each tensor's ``file``. ``encoded``: each key's ``encoded_json`` where the caller has made them already."""
    if isinstance(model, GgufHeader):
        metadata: Mapping[str, KeyValue] = model.metadata
        entries: list[tuple[GgufTensor, str | None]] = [(t, None) for t in model.tensors]
    else:
        metadata = model.metadata
        entries = [(t, f) for f, t in model.tensors]
    parts = [b'{"__metadata__":{']
    for index, (k, kv) in enumerate(metadata.items()):
        # pieces of bytes: a vocabulary's JSON is joined as it is, never decoded and encoded again
        parts += (b"," if index else b"", _json_bytes(json.dumps(k, ensure_ascii=False)), b":")
        parts.append(encoded[k] if encoded is not None else encoded_json(kv))
    members = ["}"]
    for tensor, file in entries:
        member = (
            f',{json.dumps(tensor.name, ensure_ascii=False)}:{{"dtype":"{tensor.dtype}",'
            f'"shape":{json.dumps(list(tensor.shape), separators=(",", ":"))},'
            f'"data_offsets":[{tensor.offset},{tensor.offset + tensor.nbytes}]'
        )
        if file is not None:
            member += f',"file":{json.dumps(file, ensure_ascii=False)}'
        members.append(member + "}")
    members.append("}")
    parts.append(_json_bytes("".join(members)))
    return b"".join(parts)


# -- split sets (gguf-split) -------------------------------------------------------------------------------------

SPLIT_NO = "split.no"
SPLIT_COUNT = "split.count"
SPLIT_TENSORS_COUNT = "split.tensors.count"
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True, slots=True, eq=False)
class GgufSplitSet:
    """A ``gguf-split`` set as one model: ``tensors`` pairs each tensor with the name of the split holding it."""

    name: str  # the prefix: x for x-00001-of-00003.gguf
    files: tuple[str, ...]  # the splits' names, in order
    headers: tuple[GgufHeader, ...]
    tensors: tuple[tuple[str, GgufTensor], ...]
    metadata: Mapping[str, KeyValue]  # every split's key/values, the first split's winning on a key


def split_set_names(file_name: str) -> tuple[str, list[str]] | None:
    """For a split's file name (``x-00002-of-00003.gguf``), the set's name and every split's name in order;
    ``None`` for a name that is not a split's (``gguf-split`` counts from 1)."""
    match = _SPLIT_NAME.match(file_name)
    if match is None:
        return None
    no, count = int(match["no"]), int(match["count"])
    if not 1 <= no <= count:
        return None
    prefix = match["prefix"]
    return prefix, [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def merge_splits(name: str, files: Sequence[str], headers: Sequence[GgufHeader | None]) -> GgufSplitSet:
    """Check a split set as llama.cpp's model loader does and merge it; ``headers[i]`` is ``None`` where split
    ``files[i]`` is absent. Every split present, each ``split.no`` its place (and split 0's ``split.count`` the
    number of splits), tensor names unique across splits, their number ``split.tensors.count``."""
    if len(files) != len(headers):
        raise ValueError("one header per split file")
    for file, header in zip(files, headers, strict=True):
        if header is None:
            raise errors.MissingSplit(f"{file}: split of {name!r} is missing ({len(files)} splits)")
    present = [h for h in headers if h is not None]
    for index, header in enumerate(present):
        number = _split_key(header, SPLIT_NO, GGUFValueType.UINT16)
        if number != index:
            raise errors.SplitOutOfPlace(f"{header.path}: {SPLIT_NO} is {number}, but it is split {index} of {name!r}")
    first = present[0]
    count = _split_key(first, SPLIT_COUNT, GGUFValueType.UINT16)
    if count != len(files):
        raise errors.SplitOutOfPlace(f"{first.path}: {SPLIT_COUNT} is {count}, but {name!r} has {len(files)} splits")
    expected = _split_key(first, SPLIT_TENSORS_COUNT, GGUFValueType.INT32)
    owner: dict[str, str] = {}
    tensors: list[tuple[str, GgufTensor]] = []
    metadata: dict[str, KeyValue] = {}
    for file, header in zip(files, present, strict=True):
        for tensor in header.tensors:
            if tensor.name in owner:
                raise errors.DuplicateSplitTensor(
                    f"{header.path}: tensor {tensor.name!r} is also in split {owner[tensor.name]}"
                )
            owner[tensor.name] = file
            tensors.append((file, tensor))
        for key, kv in header.metadata.items():
            metadata.setdefault(key, kv)
    if len(tensors) != expected:
        raise errors.SplitTensorCount(
            f"{first.path}: {SPLIT_TENSORS_COUNT} is {expected}, "
            f"but the {len(files)} splits hold {len(tensors)} tensors"
        )
    return GgufSplitSet(name, tuple(files), tuple(present), tuple(tensors), metadata)


def _split_key(header: GgufHeader, key: str, kind: int) -> int:
    kv = header.metadata.get(key)
    if kv is None:
        raise errors.SplitOutOfPlace(f"{header.path}: key {key!r} of a split is missing")
    if kv.type != kind:
        raise errors.SplitOutOfPlace(
            f"{header.path}: key {key!r} is of type {kv.type_name}, not {_VALUE_TYPE_NAMES[kind]}"
        )
    assert isinstance(kv.value, int)
    return kv.value


# -- the format seam: a GGUF file as every format's Header -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GgufEntry(TensorEntry):
    """A tensor of a GGUF file: its dtype is its GGML type's name, its files' xattrs ``user.gguf.*``."""

    namespace: ClassVar[str] = "gguf"


def fetch_header(
    fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = FIRST_READ
) -> Header:
    """Read and validate the GGUF file ``path`` through ``fetch`` (``read_header``) as a ``Header``: GGML type
    names, C-order shapes, metadata files' contents, ``header.json`` made in the safetensors schema; the GGUF
    header itself as ``parsed`` (a split set's checks need its key/values)."""
    cheap = first_read < CHEAP_BELOW  # a local file: reading more costs less than parsing a vocabulary again
    parsed = read_header(fetch, file_size, path=path, first_read=LOCAL_FIRST_READ if cheap else FIRST_READ)
    encoded = {key: encoded_json(kv) for key, kv in parsed.metadata.items()}  # the longest work: done once
    made = header_json(parsed, encoded)
    return Header(
        path=path,
        file_size=file_size,
        mtime_ns=mtime_ns,
        tensors=tuple(GgufEntry(t.name, t.dtype, t.shape, t.offset, t.offset + t.nbytes) for t in parsed.tensors),
        metadata=metadata_texts(parsed.metadata, encoded),
        digest=hashlib.sha256(made).digest(),
        data_start=parsed.data_offset,
        json_made=made,
        parsed=parsed,
    )


def metadata_texts(metadata: Mapping[str, KeyValue], encoded: Mapping[str, bytes] | None = None) -> dict[str, str]:
    """Each key's ``metadata/KEY`` content less its newline, as text (bytes that are not UTF-8 as surrogate
    escapes, which the tree writes back as those bytes); ``encoded``: each key's ``encoded_json``, made already."""
    found = {}
    for key, kv in metadata.items():
        if kv.type == GGUFValueType.STRING:
            found[key] = metadata_file(kv)[:-1].decode("utf-8", "surrogateescape")
        elif kv.text is not None:
            found[key] = kv.text  # the JSON of strings that are all UTF-8: nothing to escape
        else:
            found[key] = (encoded[key] if encoded is not None else encoded_json(kv)).decode("utf-8")
    return found


class _Gguf(Format):
    name = "gguf"
    title = "GGUF"
    head_size = 4

    def sniff(self, head: bytes) -> bool:
        return head[:4] == MAGIC

    def read_header(
        self, fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0
    ) -> Header:
        return fetch_header(fetch, path=path, file_size=file_size, mtime_ns=mtime_ns, first_read=first_read)

    def dtype(self, name: str) -> DType | None:
        """A GGML type by gguf-py's name: its block, and its decoding where the ``gguf`` package has one."""
        try:
            found = ggml_type(name)
        except KeyError:
            return None
        decode = _decoder(found) if found.dequantizable else None
        return DType(found.name, found.block_size, found.type_size, has_values=decode is not None, decode=decode)

    def split_set(self, file_name: str) -> tuple[str, list[str]] | None:
        return split_set_names(file_name)

    def merge_split_set(self, name: str, files: Sequence[str], headers: Sequence[Header | None]) -> SplitSet:
        merged = merge_splits(name, files, [header.parsed if header else None for header in headers])
        return SplitSet(metadata_texts(merged.metadata), header_json(merged))


def _decoder(kind: GgmlType) -> Callable[[memoryview, memoryview], None]:
    """Decoding whole blocks of ``kind`` to float32: ``gguf.quants.dequantize``, as ggml computes them."""
    from gguf.constants import GGMLQuantizationType as PackageType  # the package's own, which dequantize keys by
    from gguf.quants import dequantize

    qtype = PackageType(kind.id)

    def decode(source: memoryview, out: memoryview) -> None:
        with np.errstate(all="ignore"):  # NaN and inf scales give NaN and inf values, as ggml's do: no warning
            values = dequantize(np.frombuffer(source, dtype=np.uint8), qtype).reshape(-1)
            np.copyto(np.frombuffer(out, dtype=np.float32), values)

    return decode


FORMAT: Format = _Gguf()
