"""PyTorch checkpoints (``torch.save``), read without running them (SPEC §12).

Pure: bytes come through ``read(offset, size)``, no I/O of its own, and nothing the checkpoint names is
imported, resolved or called. The pickle is interpreted here, one loop over its opcodes, into plain values:
``GLOBAL`` and ``STACK_GLOBAL`` push a name and nothing more; a call (``REDUCE``, ``NEWOBJ``) of the names
torch's own loader uses to rebuild tensors becomes a tensor description, a call of anything else an opaque
record of the name and its arguments; ``BUILD`` and persistent ids are data. Work and memory are bounded
(``MAX_*`` below): past a bound the file is refused as invalid input.

Two layouts, as ``torch.serialization`` writes them:

* the zip archive (torch >= 1.6): stored entries under one top folder — ``data.pkl``, ``byteorder``, one
  ``data/KEY`` per storage. Only the end records, the central directory, ``data.pkl``, ``byteorder`` and
  the local headers of the storages that reachable tensors use are read; never a storage's bytes;
* the format before it (``_use_new_zipfile_serialization=False``): five pickles (magic number, protocol,
  sys_info, the object, the storage keys), then each storage, in the order of the keys, as an int64
  element count and its bytes; every storage's offset follows from the pickles (the counts are checked).

The tar format of torch 0.x and TorchScript archives are refused. Learnt from torch's
``_weights_only_unpickler.py`` and ``serialization.py`` and candle's ``pickle.rs``; a copy of neither.

Choices where SPEC §12 is silent:

* names: a tensor that is the top object itself is named ``""``; keys that are not strings are spelled as
  decimal integers, UTF-8 bytes (backslash escapes), ``repr`` of other scalars, ``<...>`` for anything else;
  two tensors on one name (keys ``1`` and ``"1"``) keep the first, the other left out with a warning;
* an opaque object (a call of a name stfs does not interpret, such as a whole pickled ``nn.Module``) is
  walked through its arguments (by position), its BUILD state (by key), and what SETITEMS and APPENDS gave
  it; BUILD on a dict or list sets attributes (an OrderedDict's ``_metadata``), not contents, and is not
  walked; a cycle is not followed;
* conjugate and negative views (their stored bytes are not their values) are left out with a warning;
* strings and bytes over ``MAX_INLINE`` are skipped unread (a placeholder stays);
* reads: local headers closer than ``COALESCE_GAP`` are read together, with the small storages between them;
  a legacy file's pickles are read in growing windows, the last of which reaches into the first storages;
* stricter than torch.load: a local header naming another entry than the central directory does, a storage
  named with two sizes, an entry twice, a storage size other than the pickle says.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .. import errors
from .base import Format, Header, RangeFetcher, TensorEntry

Read = Callable[[int, int], bytes]  # (offset, size) -> bytes, short only at the end of the file
# Several (offset, size) ranges -> their bytes, in order: where reads are costly (a remote source), the caller
# may issue them at once. Used for the ranges that do not depend on each other (the storages' local headers,
# a legacy file's counts); without one, they are read one after another through ``Read``.
ReadMany = Callable[[Sequence[tuple[int, int]]], Sequence[bytes]]

# Bounds of the pickle reader (SPEC §12): past one, the file is invalid input.
MAX_OPCODES = (
    2_000_000  # ~25 a tensor in torch.save's pickles; at worst ~200 MB of Python objects (one new string each)
)
MAX_MEMO = 1_000_000
MAX_NESTING = 1_000  # marks open at once; containers deep in the walk
MAX_WALK_STEPS = 1_000_000  # containers and tensors entered while naming tensors, each time they are reached
MAX_NAME = 65_536  # characters of a tensor's name (its path of keys)
MAX_NAME_CHARS = 64 << 20  # characters of all the names the walk makes (a reused structure of long keys)
MAX_LINE = 65_536  # a GLOBAL's module or name line
MAX_INLINE = 1 << 20  # strings and bytes longer than this are not read, only skipped (a placeholder stays)
MAX_ZIP_ENTRIES = 1_000_000
MAX_DIRECTORY = 256 << 20  # bytes of the zip's central directory
MAX_REBUILD_NESTING = 8  # _rebuild_from_type_v2 wrapping itself
WINDOW = 16 << 20  # the most one read of a pickle asks for
LEGACY_FIRST_READ = 64 << 10
TAIL_READ = 22 + 20 + 56  # the first read of a zip, from its end: the end record, ZIP64 locator and record
HEADER_SLACK = 256  # bytes past a local header's name read at once for its extra field (torch's is <= 87)
COALESCE_GAP = 4096  # two reads closer than this become one

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
# A legacy file starts with a pickle of the magic number: PROTO 2 to 5, a FRAME (protocols 4 and 5), then
# LONG1 of 10 bytes holding it.
LEGACY_MAGIC_LONG = b"\x8a\x0a" + LEGACY_MAGIC.to_bytes(10, "little")

# torch dtype name -> (safetensors dtype, itemsize); None where safetensors has no such type (left out).
TORCH_DTYPES: Mapping[str, tuple[str | None, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
    "complex64": ("C64", 8),
    "uint16": ("U16", 2),
    "uint32": ("U32", 4),
    "uint64": ("U64", 8),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "float8_e4m3fnuz": ("F8_E4M3FNUZ", 1),
    "float8_e5m2fnuz": ("F8_E5M2FNUZ", 1),
    "float8_e8m0fnu": ("F8_E8M0", 1),
    "complex128": (None, 16),
    "complex32": (None, 4),
    "qint8": (None, 1),
    "quint8": (None, 1),
    "qint32": (None, 4),
    "quint4x2": (None, 1),
    "quint2x4": (None, 1),
    "float4_e2m1fn_x2": (None, 1),  # two values a byte: safetensors' F4 counts values, torch counts bytes
    "bits1x8": (None, 1),
    "bits2x4": (None, 1),
    "bits4x2": (None, 1),
    "bits8": (None, 1),
    "bits16": (None, 2),
    **{f"uint{n}": (None, 1) for n in range(1, 8)},
    **{f"int{n}": (None, 1) for n in range(1, 8)},
}

# Storage classes (any module, as torch's loaders take them by name) -> torch dtype name.
STORAGE_DTYPES: Mapping[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
    "QInt8Storage": "qint8",
    "QUInt8Storage": "quint8",
    "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
    "UntypedStorage": "uint8",  # numel in bytes; the tensor's dtype comes from _rebuild_tensor_v3
}

# What torch.load(weights_only=True) allows: torch 2.13's _get_allowed_globals() (its
# _tensor_rebuild_functions() included), as data. tests/test_pytorch_format.py holds it to the installed torch.
_ALLOWED_BY_MODULE: Mapping[str, str] = {
    "_codecs": "encode",
    "builtins": "bytearray complex set",
    "collections": "Counter OrderedDict",
    "torch": (
        "BFloat16Storage BFloat16Tensor BoolStorage BoolTensor ByteStorage ByteTensor CharStorage CharTensor "
        "ComplexDoubleStorage ComplexFloatStorage DoubleStorage DoubleTensor FloatStorage FloatTensor HalfStorage "
        "HalfTensor IntStorage IntTensor LongStorage LongTensor QInt32Storage QInt8Storage QUInt2x4Storage "
        "QUInt4x2Storage QUInt8Storage ShortStorage ShortTensor Size Tensor "
        "bfloat16 bits16 bits1x8 bits2x4 bits4x2 bits8 bool complex128 complex32 complex64 device "
        "float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz "
        "float8_e8m0fnu int1 int16 int2 int3 int32 int4 int5 int6 int64 int7 int8 "
        "per_channel_affine per_channel_affine_float_qparams per_channel_symmetric per_tensor_affine "
        "per_tensor_symmetric qint32 qint8 quint2x4 quint4x2 quint8 "
        "uint1 uint16 uint2 uint3 uint32 uint4 uint5 uint6 uint64 uint7 uint8"
    ),
    "torch._tensor": "_rebuild_from_type_v2",
    "torch._utils": (
        "_rebuild_device_tensor_from_cpu_tensor _rebuild_device_tensor_from_numpy _rebuild_meta_tensor_no_storage "
        "_rebuild_nested_tensor _rebuild_parameter _rebuild_parameter_with_state _rebuild_qtensor "
        "_rebuild_sparse_tensor _rebuild_tensor _rebuild_tensor_v2 _rebuild_tensor_v3 _rebuild_wrapper_subclass"
    ),
    "torch.cuda": (
        "BFloat16Storage BFloat16Tensor BoolStorage BoolTensor ByteStorage ByteTensor CharStorage CharTensor "
        "ComplexDoubleStorage ComplexFloatStorage DoubleStorage DoubleTensor FloatStorage FloatTensor HalfStorage "
        "HalfTensor IntStorage IntTensor LongStorage LongTensor ShortStorage ShortTensor"
    ),
    "torch.cuda.sparse": (
        "BFloat16Tensor ByteTensor CharTensor DoubleTensor FloatTensor HalfTensor IntTensor LongTensor ShortTensor"
    ),
    "torch.nn.parameter": "Parameter",
    "torch.serialization": "_get_layout",
    "torch.sparse": (
        "BFloat16Tensor ByteTensor CharTensor DoubleTensor FloatTensor HalfTensor IntTensor LongTensor ShortTensor"
    ),
    "torch.storage": "TypedStorage UntypedStorage",
}
WEIGHTS_ONLY_GLOBALS: frozenset[str] = frozenset(
    f"{module}.{name}" for module, names in _ALLOWED_BY_MODULE.items() for name in names.split()
)

# Python 2 names a protocol-2 pickle may hold, as torch's weights_only loader maps them (torch._utils'
# IMPORT_MAPPING and NAME_MAPPING, from the standard library's _compat_pickle) before looking a name up.
IMPORT_MAPPING: Mapping[str, str] = {
    "__builtin__": "builtins",
    "copy_reg": "copyreg",
    "Queue": "queue",
    "repr": "reprlib",
    "_abcoll": "collections.abc",
    "UserDict": "collections",
    "UserList": "collections",
    "UserString": "collections",
    "whichdb": "dbm",
    "StringIO": "io",
    "cStringIO": "io",
}
NAME_MAPPING: Mapping[tuple[str, str], tuple[str, str]] = {
    ("__builtin__", "xrange"): ("builtins", "range"),
    ("__builtin__", "reduce"): ("functools", "reduce"),
    ("__builtin__", "intern"): ("sys", "intern"),
    ("__builtin__", "unichr"): ("builtins", "chr"),
    ("__builtin__", "unicode"): ("builtins", "str"),
    ("__builtin__", "long"): ("builtins", "int"),
    ("itertools", "izip"): ("builtins", "zip"),
    ("itertools", "imap"): ("builtins", "map"),
    ("itertools", "ifilter"): ("builtins", "filter"),
    ("itertools", "ifilterfalse"): ("itertools", "filterfalse"),
    ("itertools", "izip_longest"): ("itertools", "zip_longest"),
    ("UserDict", "IterableUserDict"): ("collections", "UserDict"),
    ("UserList", "UserList"): ("collections", "UserList"),
    ("UserString", "UserString"): ("collections", "UserString"),
    ("__builtin__", "basestring"): ("builtins", "str"),
    ("exceptions", "StandardError"): ("builtins", "Exception"),
    ("UserDict", "UserDict"): ("collections", "UserDict"),
}


# ---------------------------------------------------------------------------------------------------------
# What the reader returns


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor of a checkpoint: where its storage lies in the file, and how its elements lie in the storage.

    ``strides`` and ``storage_offset`` count elements, as torch does. A ``contiguous`` tensor is the one byte
    range ``(offset, nbytes)`` of the file; any other is gathered in C order from ``span`` (see ``gather``).
    """

    name: str
    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    storage: str  # the storage's key: "0" (zip), the saving process's id (legacy)
    storage_offset: int
    storage_start: int  # absolute offset of the storage's first byte in the file
    storage_size: int  # bytes

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def offset(self) -> int:
        """Absolute offset of the tensor's first element in its file (``user.pytorch.offset``)."""
        return self.storage_start + self.storage_offset * self.itemsize

    @property
    def contiguous(self) -> bool:
        """Whether the elements lie in C order one after another (torch's ``is_contiguous``)."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if size == 0:
                return True
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    @property
    def byte_range(self) -> tuple[int, int] | None:
        """``(absolute offset, size)`` of a contiguous tensor's bytes; None for a strided one."""
        return (self.offset, self.nbytes) if self.contiguous else None

    @property
    def span(self) -> tuple[int, int]:
        """``(absolute offset, size)`` of the bytes of the storage that hold the tensor's elements."""
        if self.numel == 0:
            return (self.offset, 0)
        last = sum((size - 1) * stride for size, stride in zip(self.shape, self.strides, strict=True))
        return (self.offset, (last + 1) * self.itemsize)


@dataclass(frozen=True, slots=True)
class LeftOut:
    """A tensor the checkpoint holds that is not served, and why (a warning names it)."""

    name: str
    reason: str


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What a checkpoint holds, validated: its tensors in the order it first names them, and its globals."""

    path: str
    layout: str  # "zip" or "legacy"
    file_size: int
    tensors: tuple[Tensor, ...]
    left_out: tuple[LeftOut, ...]
    globals: tuple[str, ...]  # every global the pickle names, in the order first named
    unsafe_globals: tuple[str, ...]  # those torch.load(weights_only=True) refuses: loading without it calls them
    model_key: str | None  # "state_dict" when that member of the top dict is the model
    protocol: int  # the pickle's protocol (PROTO), 0 when it has none
    pickle_range: tuple[int, int]  # (absolute offset, size) of the pickle of the object
    archive_name: str | None  # the zip's top folder

    @property
    def warnings(self) -> tuple[str, ...]:
        """One line per tensor left out, for a mount's stderr."""
        return tuple(f"{self.path}: tensor {item.name!r} left out: {item.reason}" for item in self.left_out)


# ---------------------------------------------------------------------------------------------------------
# Which format


def detect(head: bytes) -> str | None:
    """``"zip"``, ``"legacy"`` or ``"tar"`` (torch 0.x) from a file's first bytes (512 for tar), else None.

    A zip is any zip here (``read_checkpoint`` tells a checkpoint from another archive).
    """
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        magic = head[11:23] if head[2:3] == b"\x95" else head[2:14]
        if magic == LEGACY_MAGIC_LONG:
            return "legacy"
    if head[257:262] == b"ustar":
        return "tar"
    return None


def read_checkpoint(
    read: Read,
    size: int,
    *,
    path: str = "<checkpoint>",
    head: bytes | None = None,
    read_many: ReadMany | None = None,
) -> Checkpoint:
    """Read and validate the checkpoint of ``size`` bytes behind ``read``; refusals raise ``errors.PytorchError``.

    ``head``: the file's first bytes where the caller has them already (a remote source's first read), at
    least 512 of them or the whole file; else they are read. ``read_many``: see ``ReadMany``.
    """
    many = read_many or (lambda ranges: [read(offset, length) for offset, length in ranges])
    if head is None or len(head) < min(size, 512):
        head = _read_exact(read, 0, min(size, 512), path)
    kind = detect(head)
    if kind == "zip":
        return _read_zip(read, many, size, path)
    if kind == "legacy":
        return _read_legacy(read, many, size, path, head)
    if kind == "tar":
        raise errors.LegacyTarCheckpoint(
            path, "the tar format of PyTorch 0.x, which stfs does not read: re-save it with a current torch"
        )
    raise errors.NotACheckpoint(path, "neither a torch.save zip archive nor a legacy torch.save file")


# ---------------------------------------------------------------------------------------------------------
# Reading bytes


def _read_exact(read: Read, offset: int, size: int, path: str) -> bytes:
    data = read(offset, size) if size > 0 else b""
    if len(data) < size:
        raise errors.CheckpointTruncated(path, f"file ends at byte {offset + len(data)}, inside bytes {offset}+{size}")
    return bytes(data)


def _read_ranges(many: ReadMany, ranges: Sequence[tuple[int, int]], path: str) -> list[bytes]:
    """The bytes of each ``(offset, size)``, all asked for at once; ranges closer than ``COALESCE_GAP`` are one read."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    groups: list[tuple[int, int, list[int]]] = []  # start, end, the ranges it holds
    for i in order:
        start, end = ranges[i][0], sum(ranges[i])
        if groups and start <= groups[-1][1] + COALESCE_GAP:
            first, last, members = groups[-1]
            groups[-1] = (first, max(last, end), [*members, i])
        else:
            groups.append((start, end, [i]))
    blocks = many([(start, end - start) for start, end, _ in groups]) if groups else []
    out: list[bytes] = [b""] * len(ranges)
    for (start, end, members), block in zip(groups, blocks, strict=True):
        if len(block) < end - start:
            raise errors.CheckpointTruncated(
                path, f"file ends at byte {start + len(block)}, inside bytes {start}+{end - start}"
            )
        for k in members:
            offset, size = ranges[k]
            out[k] = bytes(block[offset - start : offset - start + size])
    return out


# ---------------------------------------------------------------------------------------------------------
# The pickle interpreter


@dataclass(frozen=True, slots=True)
class _Global:
    """A name the pickle pushes (``GLOBAL``, ``STACK_GLOBAL``, ``INST``, ``EXT*``): a name only."""

    module: str
    name: str

    @property
    def full(self) -> str:
        return f"{self.module}.{self.name}"


class _Object:
    """An opaque value: a call of a name stfs does not interpret, and what BUILD, SETITEMS, APPENDS gave it."""

    __slots__ = ("callee", "args", "state", "items", "elements")

    def __init__(self, callee: Any, args: Any) -> None:
        self.callee = callee
        self.args = args
        self.state: Any = None
        self.items: dict[Any, Any] | None = None
        self.elements: list[Any] | None = None


class _Set(list[Any]):
    """A set or frozenset, kept as a list: its items are never hashed (a hostile item could nest deep)."""

    __slots__ = ()


class _Key:
    """A dict key that is not a plain scalar, wrapped so that it hashes by identity, never by its contents."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


@dataclass(frozen=True, slots=True)
class _Large:
    """A string or bytes longer than ``MAX_INLINE``: skipped, never read."""

    kind: str
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class _StorageRef:
    """A persistent id ``('storage', type, key, location, numel[, view])``."""

    key: str
    dtype: str | None  # torch's name; None for a storage class stfs does not know
    numel: int  # elements of ``dtype`` (bytes for UntypedStorage)
    view: tuple[int, int] | None  # legacy storage views: (offset, size) in elements of the root storage


@dataclass(frozen=True, slots=True)
class _TensorRef:
    storage: _StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str  # torch's name


@dataclass(frozen=True, slots=True)
class _Unsupported:
    """A tensor stfs does not serve (quantized, sparse, no storage, a conjugate view, ...): why."""

    reason: str


_SCALARS = (str, int, float, bool, type(None), bytes, complex, _Global, _Large)
_LEAVES = (_TensorRef, _Unsupported, _StorageRef)

_UNPACK_I32 = struct.Struct("<i").unpack_from
_UNPACK_U16 = struct.Struct("<H").unpack_from
_UNPACK_U32 = struct.Struct("<I").unpack_from
_UNPACK_U64 = struct.Struct("<Q").unpack_from
_UNPACK_F64 = struct.Struct(">d").unpack_from


class _Stream:
    """The bytes of a pickle (or a run of them) from ``start`` up to ``limit``, read in windows."""

    __slots__ = ("read", "path", "base", "data", "limit", "window")

    def __init__(self, read: Read, path: str, start: int, limit: int, first: int, initial: bytes = b"") -> None:
        self.read = read
        self.path = path
        self.base = start  # absolute offset of data[0]
        self.limit = limit
        self.window = first
        self.data = initial

    def refill(self, pos: int, need: int) -> tuple[bytes, int]:
        """Data holding at least ``need`` bytes from position ``pos`` (which becomes 0)."""
        self.base += pos
        rest = self.data[pos:]
        if self.base + need > self.limit:
            raise errors.InvalidPickle(self.path, f"the pickle ends inside an opcode (at byte {self.limit})")
        want = min(max(need - len(rest), self.window), self.limit - self.base - len(rest))
        self.window = min(self.window * 2, WINDOW)
        self.data = rest + _read_exact(self.read, self.base + len(rest), want, self.path)
        return self.data, 0

    def skip(self, pos: int, size: int, what: str) -> tuple[bytes, int]:
        """Move past ``size`` bytes from ``pos`` without reading them."""
        if self.base + pos + size > self.limit:
            raise errors.PickleStringTooLong(
                self.path, f"a {what} of {size} bytes at byte {self.base + pos} runs past the end of the pickle"
            )
        if pos + size <= len(self.data):
            return self.data, pos + size
        self.base += pos + size
        self.data = b""
        return self.data, 0


class _Interpreter:
    """One pickle (protocols 2 to 5, and the protocol 0/1 opcodes among them) into plain values; runs nothing."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.globals: dict[str, None] = {}  # in the order first named
        self.storages: dict[str, _StorageRef] = {}  # every storage a persistent id names, by key
        self.protocol = 0
        self.opcodes = 0
        self._names: dict[tuple[str, str], _Global] = {}

    # -- values --

    def _global(self, module: str, name: str) -> _Global:
        if (module, name) in NAME_MAPPING:
            module, name = NAME_MAPPING[(module, name)]
        elif module in IMPORT_MAPPING:
            module = IMPORT_MAPPING[module]
        found = self._names.get((module, name))
        if found is None:
            found = self._names[(module, name)] = _Global(module, name)
            self.globals.setdefault(found.full, None)
        return found

    def _fail(self, detail: str) -> errors.InvalidPickle:
        return errors.InvalidPickle(self.path, detail)

    def _persistent(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or not pid:
            return _Object(_Global("persistent_load", "id"), (pid,))
        kind = pid[0].decode("ascii", "replace") if isinstance(pid[0], bytes) else pid[0]
        if kind == "module" and len(pid) >= 2:  # legacy torch.save(module): the class, by name
            return pid[1]
        if kind != "storage":
            return _Object(_Global("persistent_load", "id"), pid)
        if len(pid) not in (5, 6):
            raise self._fail(f"a storage's persistent id has {len(pid)} members, not 5 or 6")
        storage_type, key, numel = pid[1], pid[2], pid[4]
        if isinstance(key, bytes):
            key = key.decode("ascii", "replace")
        if not isinstance(storage_type, _Global) or type(key) is not str or type(numel) is not int or numel < 0:
            raise self._fail(f"a storage's persistent id is not (type, key, location, numel): {_describe(pid)}")
        dtype = STORAGE_DTYPES.get(storage_type.name)
        view = None
        if len(pid) == 6 and pid[5] is not None:
            meta = pid[5]
            if not (isinstance(meta, tuple) and len(meta) == 3 and all(type(x) is int and x >= 0 for x in meta[1:])):
                raise self._fail(f"storage {key!r}: its view is not (key, offset, size): {_describe(meta)}")
            view = (meta[1], meta[2])
        ref = _StorageRef(key, dtype, numel, view)
        known = self.storages.setdefault(key, ref)
        if (known.dtype, known.numel) != (ref.dtype, ref.numel):
            raise errors.InvalidStorage(
                self.path,
                f"storage {key!r} is named as {known.numel} x {known.dtype} and as {ref.numel} x {ref.dtype}",
            )
        return ref

    def _call(self, callee: Any, args: Any, depth: int = 0) -> Any:
        """The value of ``callee(*args)`` as stfs understands it; anything else an opaque record of the call."""
        if not isinstance(callee, _Global) or not isinstance(args, tuple):
            return _Object(callee, args)
        full = callee.full
        if full in (
            "torch._utils._rebuild_tensor_v2",
            "torch._utils._rebuild_tensor",
            "torch._utils._rebuild_tensor_v3",
        ):
            return self._rebuild_tensor(full, args)
        if full in ("torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state"):
            return args[0] if args and isinstance(args[0], (_TensorRef, _Unsupported)) else _Object(callee, args)
        if full == "torch._utils._rebuild_device_tensor_from_cpu_tensor":
            return args[0] if args and isinstance(args[0], (_TensorRef, _Unsupported)) else _Object(callee, args)
        if full == "torch._tensor._rebuild_from_type_v2":  # (func, new_type, args, state): a tensor subclass
            if len(args) == 4 and isinstance(args[2], tuple) and depth < MAX_REBUILD_NESTING:
                inner = self._call(args[0], args[2], depth + 1)
                if isinstance(inner, (_TensorRef, _Unsupported)):
                    return inner
            return _Object(callee, args)
        if full in _UNSUPPORTED_REBUILDS:
            return _Unsupported(_UNSUPPORTED_REBUILDS[full])
        if full == "collections.OrderedDict" and args == ():
            return {}
        if full == "torch.Size" and len(args) == 1 and isinstance(args[0], (tuple, list)):
            return tuple(args[0])
        if full == "_codecs.encode" and len(args) == 2 and type(args[0]) is str and args[1] in ("latin1", "latin-1"):
            try:  # how a protocol-2 pickle made by Python 3 holds bytes
                return args[0].encode("latin-1")
            except UnicodeError:
                return _Object(callee, args)
        return _Object(callee, args)

    def _rebuild_tensor(self, full: str, args: tuple[Any, ...]) -> Any:
        v3 = full.endswith("_v3")
        if len(args) < (7 if v3 else 4):
            raise self._fail(f"{full} takes at least {7 if v3 else 4} arguments, given {len(args)}")
        storage, offset, shape, strides = args[:4]
        if not isinstance(storage, _StorageRef):
            raise self._fail(f"{full}: the storage is {_describe(storage)}, not a persistent id of a storage")
        shape = _int_tuple(shape)
        strides = _int_tuple(strides)
        if shape is None or strides is None or len(shape) != len(strides):
            raise errors.InvalidTensorArgs(
                self.path, f"{full}: shape {_describe(args[2])} and strides {_describe(args[3])} of one length"
            )
        if type(offset) is not int or not 0 <= offset < 2**63:
            raise errors.InvalidTensorArgs(self.path, f"{full}: storage offset {_describe(offset)}")
        if v3:
            dtype_name = args[6]
            if not (isinstance(dtype_name, _Global) and dtype_name.module == "torch"):
                raise self._fail(f"{full}: the dtype is {_describe(dtype_name)}, not a torch dtype")
            dtype = dtype_name.name
        else:
            if storage.dtype is None:
                return _Unsupported("its storage class is not one torch writes")
            dtype = storage.dtype
        metadata = args[7] if v3 and len(args) > 7 else args[6] if not v3 and len(args) > 6 else None
        if isinstance(metadata, dict):
            flags = [flag for flag in ("conj", "neg") if metadata.get(flag) is True]
            if flags:
                return _Unsupported(f"a {' and '.join(flags)} view: its values are not its stored bytes")
        if dtype not in TORCH_DTYPES:
            return _Unsupported(f"dtype torch.{dtype}, which stfs does not know")
        return _TensorRef(storage, offset, shape, strides, dtype)

    # -- the loop --

    def run(self, stream: _Stream) -> Any:
        """Interpret one pickle from the stream's position up to its STOP; the stream stays after it."""
        path = self.path
        data, pos = stream.data, 0
        end = len(data)
        stack: list[Any] = []
        push = stack.append
        marks: list[int] = []
        memo: dict[int, Any] = {}
        opcodes = self.opcodes
        try:
            while True:
                if pos >= end:
                    data, pos = stream.refill(pos, 1)
                    end = len(data)
                op = data[pos]
                pos += 1
                opcodes += 1
                if opcodes > MAX_OPCODES:
                    raise errors.PickleLimitExceeded(path, f"more than {MAX_OPCODES:,} opcodes")
                # Most frequent first, as torch.save's pickles use them (protocols 2 and 4).
                if op == 0x71 or op == 0x72:  # BINPUT, LONG_BINPUT
                    width = 1 if op == 0x71 else 4
                    if pos + width > end:
                        data, pos = stream.refill(pos, width)
                        end = len(data)
                    index = data[pos] if width == 1 else _UNPACK_U32(data, pos)[0]
                    pos += width
                    if len(memo) >= MAX_MEMO and index not in memo:
                        raise errors.PickleLimitExceeded(path, f"more than {MAX_MEMO:,} memo entries")
                    memo[index] = stack[-1]
                elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
                    width = 1 if op == 0x68 else 4
                    if pos + width > end:
                        data, pos = stream.refill(pos, width)
                        end = len(data)
                    index = data[pos] if width == 1 else _UNPACK_U32(data, pos)[0]
                    pos += width
                    if index not in memo:
                        raise self._fail(f"memo entry {index} read before it was written")
                    push(memo[index])
                elif op == 0x4D:  # BININT2
                    if pos + 2 > end:
                        data, pos = stream.refill(pos, 2)
                        end = len(data)
                    push(_UNPACK_U16(data, pos)[0])
                    pos += 2
                elif op in _SIZED:  # BINUNICODE, SHORT_BINUNICODE, BINUNICODE8; bytes; Python 2 strings
                    width, kind = _SIZED[op]
                    if pos + width > end:
                        data, pos = stream.refill(pos, width)
                        end = len(data)
                    size = (
                        _UNPACK_U32(data, pos)[0]
                        if width == 4
                        else data[pos]
                        if width == 1
                        else _UNPACK_U64(data, pos)[0]
                    )
                    if op == 0x54 and size >= 2**31:  # BINSTRING's length is signed
                        raise self._fail("BINSTRING of a negative length")
                    pos += width
                    if size > MAX_INLINE:
                        here = stream.base + pos
                        data, pos = stream.skip(pos, size, kind)
                        end = len(data)
                        push(_Large(kind, here, size))
                        continue
                    if pos + size > end:
                        data, pos = stream.refill(pos, size)
                        end = len(data)
                    chunk = data[pos : pos + size]
                    pos += size
                    if kind == "string":
                        push(str(chunk, "utf-8", "surrogatepass"))
                    elif kind == "Python 2 string":  # text as torch.load reads it (utf-8), else bytes
                        try:
                            push(chunk.decode("utf-8"))
                        except UnicodeDecodeError:
                            push(chunk)
                    else:
                        push(chunk)
                elif op == 0x28:  # MARK
                    if len(marks) >= MAX_NESTING:
                        raise errors.PickleTooDeep(path, f"more than {MAX_NESTING} marks open at once")
                    marks.append(len(stack))
                elif op == 0x74:  # TUPLE
                    start = marks.pop()
                    made_tuple = tuple(stack[start:])
                    del stack[start:]
                    push(made_tuple)
                elif op == 0x4B:  # BININT1
                    if pos + 1 > end:
                        data, pos = stream.refill(pos, 1)
                        end = len(data)
                    push(data[pos])
                    pos += 1
                elif op == 0x52:  # REDUCE
                    args = stack.pop()
                    stack[-1] = self._call(stack[-1], args)
                elif op == 0x86:  # TUPLE2
                    second = stack.pop()
                    stack[-1] = (stack[-1], second)
                elif op == 0x94:  # MEMOIZE
                    if len(memo) >= MAX_MEMO:
                        raise errors.PickleLimitExceeded(path, f"more than {MAX_MEMO:,} memo entries")
                    memo[len(memo)] = stack[-1]
                elif op == 0x51:  # BINPERSID
                    stack[-1] = self._persistent(stack[-1])
                elif op == 0x89:  # NEWFALSE
                    push(False)
                elif op == 0x29:  # EMPTY_TUPLE
                    push(())
                elif op == 0x4A:  # BININT
                    if pos + 4 > end:
                        data, pos = stream.refill(pos, 4)
                        end = len(data)
                    push(_UNPACK_I32(data, pos)[0])
                    pos += 4
                elif op == 0x85:  # TUPLE1
                    stack[-1] = (stack[-1],)
                elif op == 0x87:  # TUPLE3
                    third = stack.pop()
                    second = stack.pop()
                    stack[-1] = (stack[-1], second, third)
                elif op == 0x88:  # NEWTRUE
                    push(True)
                elif op == 0x4E:  # NONE
                    push(None)
                elif op == 0x63 or op == 0x69:  # GLOBAL, INST: two lines, module and name
                    module, data, pos = self._line(stream, data, pos)
                    end = len(data)
                    name, data, pos = self._line(stream, data, pos)
                    end = len(data)
                    name_ref = self._global(module, name)
                    if op == 0x63:
                        push(name_ref)
                    else:
                        start = marks.pop()
                        arguments = tuple(stack[start:])
                        del stack[start:]
                        push(_Object(name_ref, arguments))
                elif op == 0x93:  # STACK_GLOBAL
                    name = stack.pop()
                    module = stack.pop()
                    if type(module) is not str or type(name) is not str:
                        raise self._fail("STACK_GLOBAL of something other than two strings")
                    push(self._global(module, name))
                elif op == 0x95:  # FRAME: a length prefix only; frames change nothing else
                    if pos + 8 > end:
                        data, pos = stream.refill(pos, 8)
                        end = len(data)
                    pos += 8
                elif op == 0x7D:  # EMPTY_DICT
                    push({})
                elif op == 0x5D:  # EMPTY_LIST
                    push([])
                elif op == 0x73:  # SETITEM
                    value = stack.pop()
                    key = stack.pop()
                    self._setitems(stack[-1], [key, value])
                elif op == 0x75:  # SETITEMS
                    start = marks.pop()
                    items = stack[start:]
                    del stack[start:]
                    self._setitems(stack[-1], items)
                elif op == 0x61:  # APPEND
                    value = stack.pop()
                    self._extend(stack[-1], [value])
                elif op == 0x65:  # APPENDS
                    start = marks.pop()
                    items = stack[start:]
                    del stack[start:]
                    self._extend(stack[-1], items)
                elif op == 0x62:  # BUILD
                    state = stack.pop()
                    target = stack[-1]
                    if isinstance(target, _Object):
                        target.state = state
                    # BUILD on anything else (an OrderedDict's _metadata, a tensor's hooks) sets attributes
                    # that are not part of its contents: kept out, as data never acted on.
                elif op == 0x81:  # NEWOBJ
                    args = stack.pop()
                    cls = stack.pop()
                    push(self._new(cls, args))
                elif op == 0x92:  # NEWOBJ_EX
                    stack.pop()  # kwargs
                    args = stack.pop()
                    cls = stack.pop()
                    push(self._new(cls, args))
                elif op == 0x8A or op == 0x8B:  # LONG1, LONG4
                    width = 1 if op == 0x8A else 4
                    if pos + width > end:
                        data, pos = stream.refill(pos, width)
                        end = len(data)
                    size = data[pos] if width == 1 else _UNPACK_I32(data, pos)[0]
                    pos += width
                    if size < 0:
                        raise self._fail("LONG4 of a negative length")
                    if size > 1024:  # no integer a checkpoint needs is this long: kept as a placeholder
                        here = stream.base + pos
                        data, pos = stream.skip(pos, size, "long integer")
                        end = len(data)
                        push(_Large("integer", here, size))
                        continue
                    if pos + size > end:
                        data, pos = stream.refill(pos, size)
                        end = len(data)
                    push(int.from_bytes(data[pos : pos + size], "little", signed=True))
                    pos += size
                elif op == 0x47:  # BINFLOAT
                    if pos + 8 > end:
                        data, pos = stream.refill(pos, 8)
                        end = len(data)
                    push(_UNPACK_F64(data, pos)[0])
                    pos += 8
                elif op == 0x80:  # PROTO
                    if pos + 1 > end:
                        data, pos = stream.refill(pos, 1)
                        end = len(data)
                    self.protocol = data[pos]
                    pos += 1
                    if self.protocol > 5:
                        raise self._fail(f"pickle protocol {self.protocol}, beyond 5")
                elif op == 0x2E:  # STOP
                    if not stack:
                        raise self._fail("STOP with an empty stack")
                    stream.base += pos
                    stream.data = data[pos:]
                    self.opcodes = opcodes
                    return stack.pop()
                elif op == 0x30:  # POP
                    if stack and (not marks or marks[-1] < len(stack)):
                        stack.pop()
                    else:
                        del stack[marks.pop() :]
                elif op == 0x31:  # POP_MARK
                    del stack[marks.pop() :]
                elif op == 0x32:  # DUP
                    push(stack[-1])
                elif op == 0x6C:  # LIST
                    start = marks.pop()
                    items = stack[start:]
                    del stack[start:]
                    push(items)
                elif op == 0x64:  # DICT
                    start = marks.pop()
                    items = stack[start:]
                    del stack[start:]
                    made: dict[Any, Any] = {}
                    self._setitems(made, items)
                    push(made)
                elif op == 0x6F:  # OBJ: the class and its arguments after a mark
                    start = marks.pop()
                    items = stack[start:]
                    del stack[start:]
                    if not items:
                        raise self._fail("OBJ without a class")
                    push(_Object(items[0], tuple(items[1:])))
                elif op == 0x8F:  # EMPTY_SET
                    push(_Set())
                elif op == 0x90:  # ADDITEMS
                    start = marks.pop()
                    items = stack[start:]
                    del stack[start:]
                    target = stack[-1]
                    if type(target) is not _Set:
                        raise self._fail(f"ADDITEMS to {_describe(target)}")
                    target.extend(items)
                elif op == 0x91:  # FROZENSET
                    start = marks.pop()
                    frozen = _Set(stack[start:])
                    del stack[start:]
                    push(frozen)
                elif op in (0x82, 0x83, 0x84):  # EXT1, EXT2, EXT4: the copyreg extension registry
                    width = {0x82: 1, 0x83: 2, 0x84: 4}[op]
                    if pos + width > end:
                        data, pos = stream.refill(pos, width)
                        end = len(data)
                    code = int.from_bytes(data[pos : pos + width], "little")
                    pos += width
                    push(self._global("copyreg.extension", str(code)))
                elif op in _TEXT_OPCODES:  # protocol 0: INT, LONG, FLOAT, STRING, UNICODE, GET, PUT, PERSID
                    line, data, pos = self._line(stream, data, pos, raw=True)
                    end = len(data)
                    data, pos = self._text_opcode(op, line, stack, memo, stream, data, pos)
                    end = len(data)
                elif op in (0x97, 0x98):  # NEXT_BUFFER, READONLY_BUFFER
                    raise self._fail("an out-of-band buffer (protocol 5), which a file cannot carry")
                else:
                    raise self._fail(f"unknown opcode 0x{op:02x} at byte {stream.base + pos - 1}")
        except errors.StfsError:
            raise
        except (IndexError, KeyError, TypeError, ValueError, UnicodeDecodeError, struct.error, RecursionError) as exc:
            kind = "an empty stack or mark stack" if isinstance(exc, IndexError) else f"{type(exc).__name__}: {exc}"
            raise self._fail(f"malformed at byte {stream.base + pos}: {kind}") from None

    def _line(self, stream: _Stream, data: bytes, pos: int, raw: bool = False) -> tuple[Any, bytes, int]:
        end = data.find(b"\n", pos)
        while end < 0:
            if len(data) - pos > MAX_LINE:
                raise errors.PickleStringTooLong(self.path, f"a line longer than {MAX_LINE} bytes")
            if stream.base + len(data) >= stream.limit:
                raise self._fail("the pickle ends inside a line")
            have = len(data) - pos
            data, pos = stream.refill(pos, min(have + 1, stream.limit - stream.base - pos))
            end = data.find(b"\n", pos + have)
        if end - pos > MAX_LINE:
            raise errors.PickleStringTooLong(self.path, f"a line longer than {MAX_LINE} bytes")
        line = data[pos:end]
        if raw:
            return line, data, end + 1
        return line.decode("utf-8"), data, end + 1

    def _text_opcode(
        self, op: int, line: bytes, stack: list[Any], memo: dict[int, Any], stream: _Stream, data: bytes, pos: int
    ) -> tuple[bytes, int]:
        if op == 0x49:  # INT (and the bools of protocol 0)
            stack.append({b"00": False, b"01": True}.get(line) if line in (b"00", b"01") else int(line))
        elif op == 0x4C:  # LONG
            stack.append(int(line[:-1] if line.endswith(b"L") else line))
        elif op == 0x46:  # FLOAT
            stack.append(float(line))
        elif op == 0x53:  # STRING: a quoted repr
            if len(line) < 2 or line[0] != line[-1] or line[:1] not in (b"'", b'"'):
                raise self._fail("STRING not quoted")
            stack.append(line[1:-1].decode("unicode_escape" if b"\\" in line else "latin-1"))
        elif op == 0x56:  # UNICODE
            stack.append(line.decode("raw-unicode-escape"))
        elif op == 0x67:  # GET
            index = int(line)
            if index not in memo:
                raise self._fail(f"memo entry {index} read before it was written")
            stack.append(memo[index])
        elif op == 0x70:  # PUT
            index = int(line)
            if len(memo) >= MAX_MEMO and index not in memo:
                raise errors.PickleLimitExceeded(self.path, f"more than {MAX_MEMO:,} memo entries")
            memo[index] = stack[-1]
        elif op == 0x50:  # PERSID
            stack.append(self._persistent(line.decode("ascii")))
        return data, pos

    def _new(self, cls: Any, args: Any) -> Any:
        if isinstance(cls, _Global):
            parameter = cls.full == "torch.nn.parameter.Parameter" and isinstance(args, tuple) and args
            if parameter and isinstance(args[0], (_TensorRef, _Unsupported)):
                return args[0]
            if cls.full == "collections.OrderedDict" and args == ():
                return {}
        return _Object(cls, args)

    def _setitems(self, target: Any, items: list[Any]) -> None:
        if len(items) % 2:
            raise self._fail("SETITEMS with an odd number of items")
        if type(target) is dict:
            mapping = target
        elif isinstance(target, _Object):
            if target.items is None:
                target.items = {}
            mapping = target.items
        else:
            raise self._fail(f"SETITEM(S) on {_describe(target)}")
        for i in range(0, len(items), 2):
            key = items[i]
            mapping[key if type(key) in _SCALARS else _Key(key)] = items[i + 1]

    def _extend(self, target: Any, items: list[Any]) -> None:
        if type(target) is list:
            target.extend(items)
        elif isinstance(target, _Object):
            if target.elements is None:
                target.elements = []
            target.elements.extend(items)
        else:
            raise self._fail(f"APPEND(S) to {_describe(target)}")


# Opcodes of a length and that many bytes -> the width of the length, and what the bytes are.
_SIZED: Mapping[int, tuple[int, str]] = {
    0x58: (4, "string"),  # BINUNICODE
    0x8C: (1, "string"),  # SHORT_BINUNICODE
    0x8D: (8, "string"),  # BINUNICODE8
    0x55: (1, "Python 2 string"),  # SHORT_BINSTRING
    0x54: (4, "Python 2 string"),  # BINSTRING
    0x43: (1, "bytes"),  # SHORT_BINBYTES
    0x42: (4, "bytes"),  # BINBYTES
    0x8E: (8, "bytes"),  # BINBYTES8
    0x96: (8, "bytes"),  # BYTEARRAY8
}
_TEXT_OPCODES = frozenset(b"ILFSVgpP")
_UNSUPPORTED_REBUILDS: Mapping[str, str] = {
    "torch._utils._rebuild_qtensor": "a quantized tensor, which safetensors cannot hold",
    "torch._utils._rebuild_sparse_tensor": "a sparse tensor, which safetensors cannot hold",
    "torch._utils._rebuild_nested_tensor": "a nested tensor, which safetensors cannot hold",
    "torch._utils._rebuild_meta_tensor_no_storage": "a meta tensor: it has no data",
    "torch._utils._rebuild_wrapper_subclass": "a tensor subclass without a storage",
    "torch._utils._rebuild_device_tensor_from_numpy": "a tensor pickled as a numpy array",
}


def _int_tuple(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, (tuple, list)) or len(value) > 64:
        return None
    if not all(type(x) is int and 0 <= x < 2**63 for x in value):
        return None
    return tuple(value)


def _describe(value: Any) -> str:
    """A short description of a pickled value for a message: never its whole contents."""
    if isinstance(value, _Global):
        return value.full
    if isinstance(value, (str, bytes)):
        return repr(value[:40]) + ("..." if len(value) > 40 else "")
    if isinstance(value, (int, float, bool, type(None))):
        text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else "a huge integer"
        return text
    if isinstance(value, _Object):
        return f"an object of {_describe(value.callee)}"
    if isinstance(value, (tuple, list, dict)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__.lstrip('_')}"


# ---------------------------------------------------------------------------------------------------------
# Naming: every tensor reachable from the top object, by its path of keys


def _segment(key: Any) -> str:
    if type(key) is str:
        return key
    if type(key) is int:
        return str(key) if key.bit_length() < 4000 else "<a huge integer>"
    if isinstance(key, bytes):
        return key.decode("utf-8", "backslashreplace")
    if isinstance(key, _Global):
        return key.full
    if isinstance(key, _Large):
        return f"<a {key.size}-byte {key.kind}>"
    if isinstance(key, _Key):
        return f"<{_describe(key.value)}>"
    return repr(key)


def _children(value: Any) -> list[tuple[Any, Any]] | None:
    """The (key, value) pairs of a container whose values are not scalars; None for a scalar."""
    kind = type(value)
    if kind is dict:
        return [(k, v) for k, v in value.items() if type(v) not in _SCALARS]
    if kind is list or kind is tuple or kind is _Set:
        return [(i, v) for i, v in enumerate(value) if type(v) not in _SCALARS]
    if kind is _Object:
        out: list[tuple[Any, Any]] = []
        if isinstance(value.args, tuple):
            out += [(i, v) for i, v in enumerate(value.args) if type(v) not in _SCALARS]
        state = value.state
        if type(state) is tuple and len(state) == 2 and all(type(s) in (dict, type(None)) for s in state):
            for part in state:
                if part:
                    out += [(k, v) for k, v in part.items() if type(v) not in _SCALARS]
        elif type(state) is dict:
            out += [(k, v) for k, v in state.items() if type(v) not in _SCALARS]
        elif type(state) in (list, tuple):
            out += [(i, v) for i, v in enumerate(state) if type(v) not in _SCALARS]
        if value.items:
            out += [(k, v) for k, v in value.items.items() if type(v) not in _SCALARS]
        if value.elements:
            out += [(i, v) for i, v in enumerate(value.elements) if type(v) not in _SCALARS]
        return out
    return None


class _Walker:
    """Names the leaves (tensors, left-out tensors, storages) reachable from a value, within the bounds."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.steps = 0
        self.chars = 0
        self._kids: dict[int, list[tuple[Any, Any]]] = {}

    def walk(self, root: Any) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if isinstance(root, _LEAVES):
            return [("", root)]
        kids = _children(root)
        if not kids:
            return out
        frames: list[tuple[Any, str | None, int]] = [(iter(kids), None, id(root))]
        on_path = {id(root)}
        kid_cache = self._kids
        while frames:
            it, prefix, ident = frames[-1]
            step = next(it, None)
            if step is None:
                frames.pop()
                on_path.discard(ident)
                continue
            self.steps += 1
            if self.steps > MAX_WALK_STEPS:
                raise errors.PickleLimitExceeded(
                    self.path, f"naming its tensors takes more than {MAX_WALK_STEPS:,} steps (a structure reused)"
                )
            key, child = step
            name = _segment(key) if prefix is None else f"{prefix}.{_segment(key)}"
            self.chars += len(name)
            if len(name) > MAX_NAME or self.chars > MAX_NAME_CHARS:
                raise errors.PickleLimitExceeded(
                    self.path, f"a path of keys over {MAX_NAME:,} characters, or all of them over {MAX_NAME_CHARS:,}"
                )
            if isinstance(child, _LEAVES):
                out.append((name, child))
                continue
            cid = id(child)
            if cid in on_path:  # a cycle: the container is being walked already
                continue
            grand = kid_cache.get(cid)
            if grand is None:
                grand = kid_cache[cid] = _children(child) or []
            if not grand:
                continue
            if len(frames) >= MAX_NESTING:
                raise errors.PickleTooDeep(self.path, f"containers nest more than {MAX_NESTING} deep")
            frames.append((iter(grand), name, cid))
            on_path.add(cid)
        return out


def _model(top: Any, walker: _Walker) -> tuple[list[tuple[str, Any]], str | None]:
    """The named leaves of the model: ``top['state_dict']`` when it is a dict holding tensors, else ``top``."""
    if type(top) is dict:
        member = top.get("state_dict")
        if type(member) is dict or (isinstance(member, _Object) and member.items is not None):
            leaves = walker.walk(member)
            if any(isinstance(leaf, (_TensorRef, _Unsupported)) for _, leaf in leaves):
                return leaves, "state_dict"
    return walker.walk(top), None


@dataclass(frozen=True, slots=True)
class _StorageBytes:
    start: int  # absolute
    size: int


def _tensors(
    leaves: list[tuple[str, Any]], storages: Mapping[str, _StorageBytes], path: str
) -> tuple[list[Tensor], list[LeftOut]]:
    tensors: list[Tensor] = []
    left_out: list[LeftOut] = []
    names: set[str] = set()
    for name, leaf in leaves:
        if name in names:
            left_out.append(LeftOut(name, "an earlier tensor has the same name"))
            continue
        names.add(name)
        if isinstance(leaf, _Unsupported):
            left_out.append(LeftOut(name, leaf.reason))
            continue
        if isinstance(leaf, _StorageRef):
            left_out.append(LeftOut(name, "a storage, not a tensor"))
            continue
        dtype, itemsize = TORCH_DTYPES[leaf.dtype]
        if dtype is None:
            left_out.append(LeftOut(name, f"dtype torch.{leaf.dtype}, which safetensors does not have"))
            continue
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            left_out.append(LeftOut(name, "its name is not valid UTF-8"))
            continue
        if name == "__metadata__":
            left_out.append(LeftOut(name, "safetensors keeps that name for its metadata"))
            continue
        where = storages[leaf.storage.key]
        start, size = where.start, where.size
        if leaf.storage.view is not None:  # a legacy storage view: a slice of its root storage
            view_offset, view_size = (n * itemsize for n in leaf.storage.view)
            if view_offset + view_size > size:
                raise errors.TensorOutOfStorage(
                    path, f"its storage is a view of bytes {view_offset}+{view_size} of a {size}-byte storage", name
                )
            start, size = start + view_offset, view_size
        tensor = Tensor(
            name=name,
            dtype=dtype,
            shape=leaf.shape,
            strides=leaf.strides,
            itemsize=itemsize,
            storage=leaf.storage.key,
            storage_offset=leaf.storage_offset,
            storage_start=start,
            storage_size=size,
        )
        span_start, span_size = tensor.span
        if span_size and span_start + span_size > start + size:
            raise errors.TensorOutOfStorage(
                path,
                f"shape {list(tensor.shape)}, strides {list(tensor.strides)} and storage offset "
                f"{tensor.storage_offset} reach byte {span_start + span_size - start} of a {size}-byte storage",
                name,
            )
        tensors.append(tensor)
    return tensors, left_out


def _checkpoint(
    *,
    path: str,
    layout: str,
    size: int,
    interpreter: _Interpreter,
    leaves: list[tuple[str, Any]],
    model_key: str | None,
    storages: Mapping[str, _StorageBytes],
    pickle_range: tuple[int, int],
    archive_name: str | None,
) -> Checkpoint:
    tensors, left_out = _tensors(leaves, storages, path)
    names = tuple(interpreter.globals)
    return Checkpoint(
        path=path,
        layout=layout,
        file_size=size,
        tensors=tuple(tensors),
        left_out=tuple(left_out),
        globals=names,
        unsafe_globals=tuple(name for name in names if name not in WEIGHTS_ONLY_GLOBALS),
        model_key=model_key,
        protocol=interpreter.protocol,
        pickle_range=pickle_range,
        archive_name=archive_name,
    )


def _used_storages(leaves: Iterable[tuple[str, Any]]) -> dict[str, _StorageRef]:
    used: dict[str, _StorageRef] = {}
    for _, leaf in leaves:
        if isinstance(leaf, _TensorRef) and TORCH_DTYPES[leaf.dtype][0] is not None:
            used.setdefault(leaf.storage.key, leaf.storage)
    return used


# ---------------------------------------------------------------------------------------------------------
# The zip layout


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    raw_name: bytes
    method: int
    flags: int
    compressed: int
    size: int
    header_offset: int
    external: int = 0  # its external attributes: 0x10, MS-DOS's directory bit, marks a folder


_EOCD = struct.Struct("<4s4H2LH")
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
_LOCAL = struct.Struct("<4s2B4HL2L2H")


def _zip_directory(read: Read, size: int, path: str) -> tuple[list[_Entry], int]:
    """The central directory's entries and its offset, read from the end of the file: never an entry's data."""
    fail = errors.InvalidZipArchive
    tail_size = min(size, TAIL_READ)
    tail = _read_exact(read, size - tail_size, tail_size, path)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 and size > tail_size:  # a comment of up to 64 KiB after the end record
        tail_size = min(size, TAIL_READ + (1 << 16) + _EOCD.size)
        tail = _read_exact(read, size - tail_size, tail_size, path)
        at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + _EOCD.size > len(tail):
        raise fail(path, "no end of central directory record")
    eocd_offset = size - tail_size + at
    _, disk, cd_disk, _, count, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, at)
    if eocd_offset + _EOCD.size + comment != size:
        raise fail(path, "the end of central directory record's comment does not end the file")
    end_of_directory = eocd_offset
    locator_offset = eocd_offset - _ZIP64_LOCATOR.size
    if locator_offset >= 0:
        locator = (
            tail[at - _ZIP64_LOCATOR.size : at]
            if at >= _ZIP64_LOCATOR.size
            else _read_exact(read, locator_offset, _ZIP64_LOCATOR.size, path)
        )
        signature, _, z64_offset, _ = _ZIP64_LOCATOR.unpack(locator)
        if signature == b"PK\x06\x07":
            if z64_offset + _ZIP64_EOCD.size > locator_offset:
                raise fail(path, f"the ZIP64 end record's offset {z64_offset} is not before its locator")
            tail_start = size - tail_size
            record = (
                tail[z64_offset - tail_start : z64_offset - tail_start + _ZIP64_EOCD.size]
                if z64_offset >= tail_start
                else _read_exact(read, z64_offset, _ZIP64_EOCD.size, path)
            )
            (signature, _, _, _, disk, cd_disk, _, count, cd_size, cd_offset) = _ZIP64_EOCD.unpack(record)
            if signature != b"PK\x06\x06":
                raise fail(path, "the ZIP64 locator points at no ZIP64 end record")
            end_of_directory = z64_offset
    if disk != 0 or cd_disk != 0:
        raise fail(path, "a multi-disk archive")
    if cd_offset + cd_size > end_of_directory:
        raise fail(path, f"the central directory ({cd_offset}+{cd_size}) overlaps its end records")
    if count > MAX_ZIP_ENTRIES or count * _CENTRAL.size > cd_size or cd_size > MAX_DIRECTORY:
        raise fail(
            path,
            f"{count} entries in a {cd_size}-byte central directory "
            f"(at most {MAX_ZIP_ENTRIES:,} entries and {MAX_DIRECTORY:,} bytes)",
        )
    tail_start = size - tail_size
    if cd_offset >= tail_start:  # read already, with the end records
        directory = tail[cd_offset - tail_start : cd_offset - tail_start + cd_size]
    else:
        directory = _read_exact(read, cd_offset, cd_size, path)
    entries: list[_Entry] = []
    pos = 0
    for _ in range(count):
        if pos + _CENTRAL.size > len(directory):
            raise fail(path, "the central directory ends inside an entry")
        fields = _CENTRAL.unpack_from(directory, pos)
        signature, flags, method = fields[0], fields[5], fields[6]
        compressed, usize, name_len, extra_len, comment_len, disk_start = (*fields[10:14], fields[14], fields[15])
        external, header_offset = fields[17], fields[18]
        if signature != b"PK\x01\x02":
            raise fail(path, f"a central directory entry without its signature at byte {cd_offset + pos}")
        pos += _CENTRAL.size
        end = pos + name_len + extra_len + comment_len
        if end > len(directory):
            raise fail(path, "the central directory ends inside an entry's name or extra field")
        raw_name = directory[pos : pos + name_len]
        extra = directory[pos + name_len : pos + name_len + extra_len]
        pos = end
        if 0xFFFFFFFF in (usize, compressed, header_offset) or disk_start == 0xFFFF:
            usize, compressed, header_offset = _zip64_extra(extra, usize, compressed, header_offset, path)
        name = raw_name.decode("utf-8" if flags & 0x800 else "cp437", "replace")
        entries.append(_Entry(name, raw_name, method, flags, compressed, usize, header_offset, external))
    return entries, cd_offset


def _zip64_extra(extra: bytes, usize: int, compressed: int, offset: int, path: str) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<2H", extra, pos)
        body = extra[pos + 4 : pos + 4 + length]
        pos += 4 + length
        if tag != 1:
            continue
        values = list(struct.unpack_from(f"<{len(body) // 8}Q", body))
        if usize == 0xFFFFFFFF:
            usize = values.pop(0) if values else -1
        if compressed == 0xFFFFFFFF:
            compressed = values.pop(0) if values else -1
        if offset == 0xFFFFFFFF:
            offset = values.pop(0) if values else -1
        if min(usize, compressed, offset) < 0:
            break
        return usize, compressed, offset
    raise errors.InvalidZipArchive(path, "an entry's ZIP64 sizes are missing from its extra field")


def _zip_layout(entries: list[_Entry], path: str) -> tuple[str, dict[str, _Entry]]:
    """The top folder and the entries by their name inside it; refusals for anything else in the archive."""
    if not entries:
        raise errors.NotACheckpoint(path, "an empty zip archive")
    top = entries[0].name.split("/", 1)[0]
    inside: dict[str, _Entry] = {}
    for entry in entries:
        head, slash, rest = entry.name.partition("/")
        if head != top or not slash or ".." in rest.split("/") or not top:
            raise errors.EntryOutsideArchive(path, f"entry {entry.name!r} is outside the top folder {top + '/'!r}")
        if not rest or rest.endswith("/"):  # a folder entry: torch writes none, other zip writers do
            continue
        if rest in inside:
            raise errors.InvalidZipArchive(path, f"entry {entry.name!r} appears twice")
        inside[rest] = entry
    if "constants.pkl" in inside or any(name.startswith("code/") for name in inside):
        raise errors.TorchScriptArchive(path, "a TorchScript archive (torch.jit.save): code, not a checkpoint")
    if "data.pkl" not in inside:
        raise errors.NotACheckpoint(path, f"a zip archive without {top}/data.pkl")
    return top, inside


def _local_headers(
    read: Read,
    many: ReadMany,
    entries: Sequence[_Entry],
    want: Sequence[int],
    bounds: Sequence[int],
    cd_start: int,
    path: str,
) -> list[tuple[int, bytes]]:
    """Each entry's absolute data offset (from its local header) and the first ``want`` bytes of its data.

    A header is read as its 30 fixed bytes and name (its extra field's length is all that is needed of the
    rest); where data is wanted too, the read reaches ``HEADER_SLACK`` further for the extra field, but not
    past ``bounds`` (the next entry's header): never into another entry's data. Headers that lie close are
    read together (small storages between them along).
    """
    ranges = []
    for entry, wanted, bound in zip(entries, want, bounds, strict=True):
        fixed = _LOCAL.size + len(entry.raw_name)
        if entry.header_offset + fixed > cd_start:
            raise errors.InvalidZipArchive(path, f"entry {entry.name!r}: its local header lies past the entries")
        length = fixed + (HEADER_SLACK + wanted if wanted else 0)
        ranges.append((entry.header_offset, max(fixed, min(length, bound - entry.header_offset))))
    blocks = _read_ranges(many, ranges, path)
    out = []
    for entry, wanted, block in zip(entries, want, blocks, strict=True):
        signature, _, _, _, method, _, _, _, _, _, name_len, extra_len = _LOCAL.unpack_from(block)
        if signature != b"PK\x03\x04":
            raise errors.InvalidZipArchive(path, f"entry {entry.name!r}: no local header at byte {entry.header_offset}")
        if block[_LOCAL.size : _LOCAL.size + name_len] != entry.raw_name or method != entry.method:
            raise errors.InvalidZipArchive(path, f"entry {entry.name!r}: its local header names another entry")
        inner = _LOCAL.size + name_len + extra_len
        start = entry.header_offset + inner
        if start + entry.compressed > cd_start:
            raise errors.InvalidZipArchive(
                path, f"entry {entry.name!r}: its data ({start}+{entry.compressed}) runs into the central directory"
            )
        data = block[inner : inner + wanted]
        if len(data) < wanted:
            data = _read_exact(read, start, wanted, path)
        out.append((start, data))
    return out


def _next_headers(wanted: Sequence[_Entry], entries: Sequence[_Entry], cd_start: int) -> list[int]:
    """For each wanted entry, where the next entry's local header (or the central directory) begins."""
    starts = sorted({e.header_offset for e in entries} | {cd_start})
    return [next((s for s in starts if s > entry.header_offset), entry.header_offset) for entry in wanted]


def _stored(entry: _Entry, path: str) -> None:
    if entry.external & 0x10:  # torch's reader (miniz) takes it for a folder and reads none of its bytes
        raise errors.InvalidZipArchive(path, f"entry {entry.name!r} is marked a directory (its external attributes)")
    if entry.flags & 0x1:
        raise errors.CompressedEntry(path, f"entry {entry.name!r} is encrypted")
    if entry.method != 0 or entry.compressed != entry.size:
        raise errors.CompressedEntry(
            path, f"entry {entry.name!r} is compressed (method {entry.method}); torch.save stores every entry"
        )


def _read_zip(read: Read, many: ReadMany, size: int, path: str) -> Checkpoint:
    entries, cd_start = _zip_directory(read, size, path)
    top, inside = _zip_layout(entries, path)
    wanted = [inside["data.pkl"]] + ([inside["byteorder"]] if "byteorder" in inside else [])
    for entry in wanted:
        _stored(entry, path)
    # data.pkl and byteorder (written right after it) with their local headers: one read where they fit.
    (pickle_start, first), *order = _local_headers(
        read,
        many,
        wanted,
        [min(e.size, WINDOW) for e in wanted],
        _next_headers(wanted, entries, cd_start),
        cd_start,
        path,
    )
    if order and order[0][1] != b"little":
        raise errors.BigEndianCheckpoint(
            path, f"its byteorder record says {order[0][1][:16]!r}: stfs reads little-endian checkpoints only"
        )
    pickle_size = wanted[0].size
    interpreter = _Interpreter(path)
    top_object = interpreter.run(_Stream(read, path, pickle_start, pickle_start + pickle_size, WINDOW, first))
    leaves, model_key = _model(top_object, _Walker(path))
    data_entries = []
    for key, ref in _used_storages(leaves).items():
        found_entry = inside.get(f"data/{key}")
        if found_entry is None:
            raise errors.InvalidStorage(path, f"storage {key!r} has no entry {top}/data/{key}")
        entry = found_entry
        _stored(entry, path)
        itemsize = TORCH_DTYPES[ref.dtype][1] if ref.dtype is not None else 1
        if ref.numel * itemsize != entry.size:
            raise errors.InvalidStorage(
                path,
                f"storage {key!r} holds {ref.numel} x {ref.dtype} in the pickle, {entry.size} bytes in {entry.name}",
            )
        data_entries.append((key, entry))
    storage_entries = [entry for _, entry in data_entries]
    zeros = [0] * len(storage_entries)
    found = _local_headers(read, many, storage_entries, zeros, [cd_start] * len(zeros), cd_start, path)
    storages = {
        key: _StorageBytes(start, entry.size) for (key, entry), (start, _) in zip(data_entries, found, strict=True)
    }
    return _checkpoint(
        path=path,
        layout="zip",
        size=size,
        interpreter=interpreter,
        leaves=leaves,
        model_key=model_key,
        storages=storages,
        pickle_range=(pickle_start, pickle_size),
        archive_name=top,
    )


# ---------------------------------------------------------------------------------------------------------
# The legacy layout (torch.save(..., _use_new_zipfile_serialization=False))


def _read_legacy(read: Read, many: ReadMany, size: int, path: str, head: bytes) -> Checkpoint:
    interpreter = _Interpreter(path)
    stream = _Stream(read, path, 0, size, LEGACY_FIRST_READ, head)
    magic = interpreter.run(stream)
    if magic != LEGACY_MAGIC:
        raise errors.NotACheckpoint(path, "the first pickle is not torch's magic number")
    protocol = interpreter.run(stream)
    if protocol != LEGACY_PROTOCOL:
        raise errors.NotACheckpoint(path, f"legacy protocol version {_describe(protocol)}, not {LEGACY_PROTOCOL}")
    sys_info = interpreter.run(stream)
    if type(sys_info) is dict and sys_info.get("little_endian") is False:
        raise errors.BigEndianCheckpoint(
            path, "its sys_info says big-endian: stfs reads little-endian checkpoints only"
        )
    pickle_start = stream.base
    top_object = interpreter.run(stream)
    pickle_size = stream.base - pickle_start
    keys = interpreter.run(stream)
    if not isinstance(keys, list) or not all(type(k) is str for k in keys):
        raise errors.InvalidPickle(path, f"the storage keys are {_describe(keys)}, not a list of strings")
    # Each storage, in the order of the keys: an int64 element count, then its bytes.
    storages: dict[str, _StorageBytes] = {}
    counts: list[tuple[str, int, int]] = []  # key, offset of its count, numel
    offset = stream.base
    for key in keys:
        ref = interpreter.storages.get(key)
        if ref is None:
            raise errors.InvalidStorage(path, f"storage {key!r} is in the list of keys but no tensor names it")
        if key in storages:
            raise errors.InvalidStorage(path, f"storage {key!r} is listed twice")
        if ref.dtype is None:
            raise errors.InvalidStorage(path, f"storage {key!r} is of a class stfs does not know: its size is unknown")
        nbytes = ref.numel * TORCH_DTYPES[ref.dtype][1]
        counts.append((key, offset, ref.numel))
        storages[key] = _StorageBytes(offset + 8, nbytes)
        offset += 8 + nbytes
    if offset > size:
        raise errors.CheckpointTruncated(
            path, f"its storages end at byte {offset}, past the end of the {size}-byte file"
        )
    for key in interpreter.storages:
        if key not in storages:
            raise errors.InvalidStorage(path, f"storage {key!r} is named by a tensor but not in the list of keys")
    for (key, at, numel), raw in zip(counts, _read_ranges(many, [(at, 8) for _, at, _ in counts], path), strict=True):
        (count,) = struct.unpack("<q", raw)
        if count != numel:
            raise errors.InvalidStorage(path, f"storage {key!r}: {count} elements at byte {at}, {numel} in the pickle")
    leaves, model_key = _model(top_object, _Walker(path))
    return _checkpoint(
        path=path,
        layout="legacy",
        size=size,
        interpreter=interpreter,
        leaves=leaves,
        model_key=model_key,
        storages=storages,
        pickle_range=(pickle_start, pickle_size),
        archive_name=None,
    )


# ---------------------------------------------------------------------------------------------------------
# The equivalent safetensors file, and a tensor's bytes in C order


@dataclass(frozen=True, slots=True)
class SafetensorsFile:
    """The safetensors file holding some tensors: its header, then each tensor's bytes at ``placements``."""

    header: bytes  # 8-byte length, JSON, spaces to a multiple of 8: what the safetensors writer makes
    placements: tuple[tuple[Tensor, int], ...]  # each tensor and the absolute offset of its bytes in the file

    @property
    def size(self) -> int:
        return len(self.header) + sum(tensor.nbytes for tensor, _ in self.placements)


def safetensors_file(tensors: Sequence[Tensor]) -> SafetensorsFile:
    """The safetensors file of ``tensors`` in their order, ``__metadata__`` ``{"format": "pt"}`` (SPEC §12).

    Tied weights are two tensors and have their bytes twice, so the file is valid for the reference.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    begin = 0
    relative = []
    for tensor in tensors:
        if tensor.name in header:
            raise ValueError(f"two tensors named {tensor.name!r}")
        end = begin + tensor.nbytes
        header[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [begin, end]}
        relative.append(begin)
        begin = end
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    raw = struct.pack("<Q", len(text)) + text
    return SafetensorsFile(raw, tuple((tensor, len(raw) + at) for tensor, at in zip(tensors, relative, strict=True)))


def safetensors_header(tensors: Sequence[Tensor]) -> bytes:
    """The header (length, JSON, padding) of ``safetensors_file(tensors)``."""
    return safetensors_file(tensors).header


def gather(tensor: Tensor, read: Read, begin: int = 0, end: int | None = None) -> bytes:
    """Bytes ``begin`` to ``end`` of the tensor's elements in C order, read through ``read``.

    A contiguous tensor is one read; a strided one reads the span of its storage that the elements asked for
    lie in (the smallest block of its leading indices that holds them) and orders them with numpy.
    """
    import numpy as np

    total = tensor.nbytes
    end = total if end is None else min(end, total)
    if begin >= end:
        return b""
    if tensor.contiguous:
        return _read_exact(read, tensor.offset + begin, end - begin, "<gather>")
    size = tensor.itemsize
    first, last = begin // size, (end - 1) // size  # elements, C order
    # The smallest block (fixed leading indices, all of the rest) holding elements first..last.
    level = 0
    block = tensor.numel
    for dim in tensor.shape:
        inner = block // dim
        if first // inner != last // inner:
            break
        level += 1
        block = inner
    block_start = (first // block) * block
    index, base = block_start, tensor.storage_offset
    for stride, inner in zip(tensor.strides[:level], _inner_sizes(tensor.shape)[:level], strict=True):
        base += (index // inner) * stride
        index %= inner
    shape, strides = tensor.shape[level:], tensor.strides[level:]
    span = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1
    raw = _read_exact(read, tensor.storage_start + base * size, span * size, "<gather>")
    elements = np.lib.stride_tricks.as_strided(
        np.frombuffer(raw, dtype=np.dtype(f"V{size}")),
        shape=shape,
        strides=[s * size for s in strides],
        writeable=False,
    )
    flat = np.ascontiguousarray(elements).reshape(-1)[first - block_start : last - block_start + 1].tobytes()
    return flat[begin - first * size : end - first * size]


def _inner_sizes(shape: Sequence[int]) -> list[int]:
    """For each dimension, the number of elements one step along it spans in C order."""
    out = []
    block = math.prod(shape)
    for dim in shape:
        block //= dim
        out.append(block)
    return out


# ---------------------------------------------------------------------------------------------------------
# The format seam: a checkpoint as every format's Header


@dataclass(frozen=True, slots=True)
class PytorchEntry(TensorEntry):
    """A tensor of a checkpoint: ``begin``/``end`` are absolute offsets in the file (its ``Header`` has
    ``data_start`` 0: a checkpoint's storages are not one data section); its files' xattrs ``user.pytorch.*``.

    ``tensor``: the reader's ``Tensor`` (its storage, strides and offset), where a strided one is gathered from.
    """

    namespace: ClassVar[str] = "pytorch"
    tensor: Tensor | None = None

    @property
    def scattered(self) -> Strided | None:
        return Strided(self.tensor) if self.tensor is not None and not self.tensor.contiguous else None


@dataclass(frozen=True, slots=True)
class Strided:
    """A strided tensor of a checkpoint (a transpose, a slice with a step) as every format's ``Scattered``: its
    elements gathered in C order from its storage."""

    tensor: Tensor

    @property
    def offset(self) -> int:
        return self.tensor.offset

    @property
    def span(self) -> tuple[int, int]:
        return self.tensor.span

    def read_into(self, read: Read, begin: int, view: memoryview) -> None:
        gather_into(self.tensor, read, begin, view)


def fetch_header(fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0) -> Header:
    """Read and validate the checkpoint ``path`` through ``fetch`` as a ``Header``: its tensors (``begin``/``end``
    absolute: a contiguous one's bytes; a strided one's ``end - begin`` its size in C order, gathered by its
    ``tensor``), ``header.json`` the equivalent safetensors file's JSON, metadata ``{"format": "pt"}``;
    the ``Checkpoint`` itself as ``parsed`` (its globals, for ``check``)."""
    checkpoint = read_checkpoint(fetch, file_size, path=path, read_many=getattr(fetch, "many", None))
    served = checkpoint.tensors
    made = header_json(served)
    return Header(
        path=path,
        file_size=file_size,
        mtime_ns=mtime_ns,
        tensors=tuple(
            PytorchEntry(tensor.name, tensor.dtype, tensor.shape, tensor.offset, tensor.offset + tensor.nbytes, tensor)
            for tensor in served
        ),
        metadata={"format": "pt"},
        digest=hashlib.sha256(made).digest(),
        data_start=0,
        json_made=made,
        parsed=checkpoint,
        warnings=checkpoint.warnings + unsafe_warnings(checkpoint),
        format="pytorch",
        check_problems=unsafe_warnings(checkpoint),
        scattered=not all(tensor.contiguous for tensor in served),
    )


def unsafe_warnings(checkpoint: Checkpoint) -> tuple[str, ...]:
    """One line per global the checkpoint names that ``torch.load(weights_only=True)`` refuses (SPEC §12)."""
    return tuple(
        f"{checkpoint.path}: names the global {name!r}: loading it without weights_only=True would import and call it"
        for name in checkpoint.unsafe_globals
    )


def header_json(tensors: Sequence[Tensor]) -> bytes:
    """``header.json`` of a checkpoint: the JSON of ``safetensors_file(tensors)``'s header, less its length and
    padding."""
    return safetensors_header(tensors)[8:].rstrip(b" ")


GATHER_WINDOW = 8 << 20  # the most bytes of a storage one read of a strided tensor asks for
GATHER_GAP = 64 << 10  # elements further apart than this are read apart (a gap costs more than another read)
GATHER_ELEMENTS = 1 << 18  # elements of a strided tensor gathered at once: their positions are 2 MiB of int64


def gather_into(tensor: Tensor, read: Read, begin: int, view: memoryview) -> None:
    """Fill ``view`` with the bytes from ``begin`` of the tensor's elements in C order (within ``nbytes``).

    Bounded whatever the tensor's size: ``GATHER_ELEMENTS`` elements at a time, whose positions in the storage are
    sorted and read in windows of at most ``GATHER_WINDOW`` bytes, split where they lie ``GATHER_GAP`` apart (a
    slice with a large step, or the rows of a transpose, read as the parts that hold them).
    """
    import numpy as np

    size = tensor.itemsize
    item = np.dtype(f"V{size}")
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
        order = np.argsort(positions, kind="stable")
        ordered = positions[order]
        gaps = np.flatnonzero(np.diff(ordered) * size > GATHER_GAP)
        out = np.empty(len(ordered), dtype=item)
        start = 0
        while start < len(ordered):
            stop = int(np.searchsorted(ordered, ordered[start] + GATHER_WINDOW // size, side="left"))
            cut = int(np.searchsorted(gaps, start, side="left"))
            if cut < len(gaps) and gaps[cut] + 1 < stop:
                stop = int(gaps[cut]) + 1
            low = int(ordered[start])
            raw = _read_exact(
                read, tensor.storage_start + low * size, (int(ordered[stop - 1]) - low + 1) * size, "<gather>"
            )
            out[order[start:stop]] = np.frombuffer(raw, dtype=item)[ordered[start:stop] - low]
            start = stop
        chunk = memoryview(out.view(np.uint8).data)
        skip = begin + done - first * size
        length = min(end - begin - done, len(chunk) - skip)
        view[done : done + length] = chunk[skip : skip + length]
        done += length


def safetensors_name(path: str) -> str:
    """The name in ``--view safetensors`` of a checkpoint's file or a checkpoints' index (SPEC §12)."""
    folder, _, name = path.rpartition("/")
    if name == "pytorch_model.bin.index.json":
        name = "model.safetensors.index.json"
    elif name.startswith("pytorch_model") and name.endswith(".bin"):
        name = "model" + name[len("pytorch_model") : -len(".bin")] + ".safetensors"
    else:
        name = name[: name.rindex(".")] + ".safetensors"
    return f"{folder}/{name}" if folder else name


class _Pytorch(Format):
    name = "pytorch"
    title = "PyTorch checkpoint"
    head_size = 512  # a tar's "ustar" is at 257
    confirm_in_folder = True  # any .bin: a checkpoint only if its first bytes are one's

    def sniff(self, head: bytes) -> bool:
        return detect(head) is not None

    def read_header(
        self, fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0
    ) -> Header:
        return fetch_header(fetch, path=path, file_size=file_size, mtime_ns=mtime_ns, first_read=first_read)

    def safetensors_name(self, path: str) -> str | None:
        return safetensors_name(path)


FORMAT: Format = _Pytorch()
