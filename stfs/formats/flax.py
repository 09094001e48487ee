"""Flax's msgpack checkpoints: ``flax.serialization.to_bytes`` (``flax_model.msgpack``, and the shards of
transformers' ``flax_model.msgpack.index.json``), read as ``flax.serialization.msgpack_restore`` reads them (SPEC §17).

A file is one msgpack map, the state dict: keys are strings, values maps, plain msgpack values, or arrays as msgpack
ext type 1 (type 3: a numpy scalar), whose payload is itself msgpack, ``[shape, dtype name, bytes]``. Arrays flax
splits (over 1 GiB) are a map ``{"__msgpack_chunked_array__": true, "shape": {"0": n, ...}, "chunks": {"0": array,
...}}`` of flat chunks, concatenated in order. Each array is a tensor named by its path of keys joined by ``.`` (a
shard's keys hold ``/``: those are ``.`` too), its bytes the range of its payload's ``bytes``; a chunked array a
gathered tensor of its chunks; plain values go to ``metadata/`` (strings as they are, the rest as JSON).

The framing is walked here, a window at a time, every array's bytes passed over: the ``msgpack`` package reads each
value whole (a 1 GiB ``bin`` into memory) and has no way to give a payload's offset instead, so it cannot serve. The
walk bounds what a hostile file can cost: nesting depth, values walked, plain bytes held, every length against the
file's size. Refused in one line, naming the file and the tensor: complex128, string and object arrays (and any dtype
safetensors has no name for), bytes that are not the shape's, ext types flax does not write, truncated msgpack.
A ``.msgpack`` whose top level is not a map, or that holds no array, is not a Flax checkpoint: left in ``files/``.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from .. import errors
from .base import Format, Header, RangeFetcher, Read, Rows, TensorEntry, made_header

WINDOW = 65536  # bytes of the file read at once while walking its framing
MAX_DEPTH = 64  # maps and arrays nested deeper than this are refused (flax's state dicts nest a few levels)
MAX_VALUES = 1_000_000  # msgpack values walked in one file (a checkpoint holds a few per tensor)
PLAIN_LIMIT = 16 << 20  # bytes of plain values (strings, bins) kept for metadata/
CHUNKED = "__msgpack_chunked_array__"
ARRAY, COMPLEX, SCALAR = 1, 2, 3  # flax's ext types: an ndarray, a Python complex, a numpy scalar
# numpy's dtype name (as flax writes it, ``arr.dtype.name``) -> safetensors' dtype and its bytes
DTYPES = {
    "bool": ("BOOL", 1),
    "uint8": ("U8", 1),
    "int8": ("I8", 1),
    "uint16": ("U16", 2),
    "int16": ("I16", 2),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "uint32": ("U32", 4),
    "int32": ("I32", 4),
    "float32": ("F32", 4),
    "uint64": ("U64", 8),
    "int64": ("I64", 8),
    "float64": ("F64", 8),
    "complex64": ("C64", 8),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "float8_e8m0fnu": ("F8_E8M0", 1),
    "float8_e4m3fnuz": ("F8_E4M3FNUZ", 1),
    "float8_e5m2fnuz": ("F8_E5M2FNUZ", 1),
}


class FlaxError(errors.RuleError):
    """A Flax msgpack file is refused: ``flax.serialization.msgpack_restore`` would not read it, or it holds what a
    tensor file cannot serve."""

    format_name = "Flax msgpack file"
    rule_text = "invalid Flax msgpack file"
    advice = "flax.serialization.msgpack_restore refuses it too: save the state again with flax.serialization.to_bytes"


class NotFlax(FlaxError):
    """The file is no Flax checkpoint (its top level is not a map, or it holds no array): left in ``files/``."""

    rule_text = "a state dict of arrays"
    refutes_format = True
    advice = "flax.serialization.to_bytes writes a map holding arrays: a file of other values is no checkpoint"


class InvalidMsgpack(FlaxError):
    """The msgpack framing is broken: a marker msgpack does not have, a key that is not a string, nesting too deep."""

    rule_text = "msgpack framing"


class FlaxTruncated(FlaxError):
    """The file ends inside a value its framing says is there."""

    rule_text = "bytes inside the file"
    advice = errors.CUT_SHORT


class InvalidArray(FlaxError):
    """An array's payload is not ``[shape, dtype name, bytes]`` with as many bytes as its shape needs."""

    rule_text = "array payload"


class UnsupportedDtype(FlaxError):
    """An array of a dtype safetensors has no name for (complex128, strings, objects)."""

    rule_text = "a dtype safetensors has"
    advice = "save it as an array of a dtype safetensors has (complex64 for complex128); keep strings out of arrays"


class InvalidChunkedArray(FlaxError):
    """A ``__msgpack_chunked_array__`` map is not flax's: its shape and chunks, flat arrays of one dtype."""

    rule_text = "chunked array"


@dataclass(frozen=True, slots=True)
class Array:
    """An array's payload read: its shape, dtype name and the range of its bytes."""

    shape: tuple[int, ...]
    dtype: str
    start: int
    size: int


@dataclass(frozen=True, slots=True)
class Ext:
    """An ext value of the framing: its type and where its payload lies; an array's (type 1 or 3) read as it is met
    (``array``, or why not: ``problem``, raised once its name is known), a complex's pair (``pair``)."""

    code: int
    start: int
    size: int
    array: Array | None = None
    problem: FlaxError | None = None
    pair: Any = None


class Framing:
    """The msgpack values of the file ``path``, read through ``fetch`` a window at a time; payloads of arrays passed
    over. ``value()`` gives a plain Python value, a ``dict`` (keys in file order), a ``list`` or an ``Ext``."""

    def __init__(self, fetch: RangeFetcher, path: str, file_size: int, window: int) -> None:
        self.fetch, self.path, self.file_size, self.window = fetch, path, file_size, window
        self.buffer, self.at, self.pos = b"", 0, 0
        self.values = 0
        self.plain = 0

    def take(self, size: int) -> bytes:
        """The next ``size`` bytes; ``FlaxTruncated`` where the file ends before."""
        end = self.pos + size
        if end > self.file_size:
            raise FlaxTruncated(self.path, f"the file ends at byte {self.file_size}, inside a value at {self.pos}")
        if not (self.at <= self.pos and end <= self.at + len(self.buffer)):
            want = min(max(size, self.window), self.file_size - self.pos)
            self.buffer, self.at = bytes(self.fetch(self.pos, want)), self.pos
            if len(self.buffer) < size:
                raise FlaxTruncated(self.path, f"the file ends at byte {self.pos + len(self.buffer)}")
        data = self.buffer[self.pos - self.at : end - self.at]
        self.pos = end
        return data

    def skip(self, size: int) -> int:
        """Pass over ``size`` bytes; where they start."""
        start = self.pos
        if start + size > self.file_size:
            raise FlaxTruncated(self.path, f"the file ends at byte {self.file_size}, inside {size} bytes at {start}")
        self.pos = start + size
        return start

    def unpack(self, code: str) -> Any:
        return struct.unpack(code, self.take(struct.calcsize(code)))[0]

    def count(self, n: int, each: int) -> int:
        """``n`` items of at least ``each`` bytes, if the file can hold them."""
        if n * each > self.file_size - self.pos:
            raise FlaxTruncated(self.path, f"{n} values at byte {self.pos} cannot fit in the {self.file_size} bytes")
        return n

    def held(self, size: int) -> bytes:
        """A plain string's or bin's ``size`` bytes, kept (within ``PLAIN_LIMIT`` in all)."""
        self.plain += size
        if self.plain > PLAIN_LIMIT:
            raise InvalidMsgpack(self.path, f"its plain values hold more than {PLAIN_LIMIT} bytes")
        return self.take(size)

    def value(self, depth: int = 0, ext_bytes: bool = False) -> Any:
        """The next value; ``ext_bytes``: a bin or str is passed over (an array's bytes) as an ``Ext`` of code -1."""
        self.values += 1
        if self.values > MAX_VALUES:
            raise InvalidMsgpack(self.path, f"it holds more than {MAX_VALUES} msgpack values")
        if depth > MAX_DEPTH:
            raise InvalidMsgpack(self.path, f"values nest more than {MAX_DEPTH} deep at byte {self.pos}")
        at = self.pos
        marker = self.take(1)[0]
        if marker <= 0x7F or marker >= 0xE0:
            return marker if marker <= 0x7F else marker - 0x100
        if 0x80 <= marker <= 0x8F:
            return self.map(marker & 0x0F, depth)
        if 0x90 <= marker <= 0x9F:
            return self.array(marker & 0x0F, depth)
        if 0xA0 <= marker <= 0xBF:
            return self.text(marker & 0x1F, ext_bytes)
        simple = {0xC0: None, 0xC2: False, 0xC3: True}
        if marker in simple:
            return simple[marker]
        sized = {0xC4: ">B", 0xC5: ">H", 0xC6: ">I", 0xD9: ">B", 0xDA: ">H", 0xDB: ">I"}
        if marker in sized:
            size = self.unpack(sized[marker])
            if ext_bytes:
                return Ext(-1, self.skip(size), size)
            return self.held(size) if marker <= 0xC6 else self.text(size, False)
        numbers = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q"}
        numbers |= {0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
        if marker in numbers:
            return self.unpack(numbers[marker])
        if 0xD4 <= marker <= 0xD8 or marker in (0xC7, 0xC8, 0xC9):
            fixed = 1 << (marker - 0xD4) if marker >= 0xD4 else None
            size = fixed if fixed is not None else self.unpack({0xC7: ">B", 0xC8: ">H", 0xC9: ">I"}[marker])
            return self.ext(self.unpack(">b"), size, depth)
        if marker in (0xDC, 0xDD):
            return self.array(self.unpack(">H" if marker == 0xDC else ">I"), depth)
        if marker in (0xDE, 0xDF):
            return self.map(self.unpack(">H" if marker == 0xDE else ">I"), depth)
        raise InvalidMsgpack(self.path, f"byte {at} is 0xc1, which msgpack never uses")

    def ext(self, code: int, size: int, depth: int) -> Ext:
        """An ext value of ``size`` bytes from here: an array's payload read now, where its framing is at hand."""
        start = self.pos
        if code < 0:  # msgpack's own (-1: a timestamp), which no flax file holds
            raise InvalidMsgpack(
                self.path, f"the ext value at byte {start} is of type {code}, which flax does not write"
            )
        if code in (ARRAY, SCALAR):
            try:
                array = read_array(self, start, size)
            except FlaxError as exc:
                self.pos = start
                self.skip(size)
                return Ext(code, start, size, problem=exc)
            return Ext(code, start, size, array)
        if code == COMPLEX:
            pair = self.value(depth + 1)
            numbers = isinstance(pair, list) and len(pair) == 2 and all(type(n) in (int, float) for n in pair)
            if self.pos != start + size or not numbers:
                raise InvalidMsgpack(self.path, f"the complex at byte {start} is not one pair of numbers")
            return Ext(code, start, size, pair=pair)
        return Ext(code, self.skip(size), size)

    def text(self, size: int, ext_bytes: bool) -> Any:
        if ext_bytes:
            return Ext(-1, self.skip(size), size)
        raw = self.held(size)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidMsgpack(self.path, f"a string at byte {self.pos - size} is not UTF-8") from None

    def array(self, n: int, depth: int) -> list[Any]:
        return [self.value(depth + 1) for _ in range(self.count(n, 1))]

    def map(self, n: int, depth: int) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for _ in range(self.count(n, 2)):
            at = self.pos
            key = self.value(depth + 1)
            if not isinstance(key, str):
                raise InvalidMsgpack(self.path, f"the key at byte {at} is {type(key).__name__}, not a string")
            if key in found:
                raise InvalidMsgpack(self.path, f"the key {key!r} at byte {at} is in its map twice")
            found[key] = self.value(depth + 1)
        return found


def read_array(framing: Framing, start: int, size: int) -> Array:
    """The array whose payload is the ``size`` bytes at ``start`` (its ``[shape, dtype name, bytes]``), as
    ``_ndarray_from_bytes`` reads it; its errors name no tensor (``Ext.problem``)."""
    path = framing.path
    marker = framing.take(1)[0]
    if marker != 0x93:  # a fixarray of 3, as msgpack.packb writes a tuple of three
        raise InvalidArray(path, f"its payload at byte {start} is not [shape, dtype, bytes]")
    shape = framing.value(1)
    dtype = framing.value(1)
    data = framing.value(1, ext_bytes=True)
    if framing.pos != start + size or not isinstance(data, Ext) or data.code != -1:
        raise InvalidArray(path, f"its payload at byte {start} is not [shape, dtype, bytes] exactly")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise InvalidArray(path, f"its shape {shape!r:.60} is not a list of non-negative integers")
    if isinstance(dtype, bytes):
        dtype = dtype.decode("utf-8", "replace")
    if not isinstance(dtype, str):
        raise InvalidArray(path, f"its dtype {dtype!r:.60} is not a name")
    if dtype not in DTYPES:
        raise UnsupportedDtype(path, f"its dtype is {dtype!r:.40}, which safetensors has no name for")
    nbytes = math.prod(shape) * DTYPES[dtype][1]
    if data.size != nbytes:
        raise InvalidArray(path, f"shape {shape} of {dtype} is {nbytes} bytes, it holds {data.size}")
    return Array(tuple(shape), dtype, data.start, data.size)


def array_of(ext: Ext, name: str) -> Array:
    """The array ``ext`` holds; its problem raised, naming the tensor ``name``, where it holds none."""
    if ext.problem is not None:
        raise type(ext.problem)(ext.problem.path, ext.problem.detail, name)
    assert ext.array is not None
    return ext.array


@dataclass(frozen=True, slots=True)
class Chunks:
    """A chunked array's bytes: its chunks' ranges of the file, one after another in C order (a ``Scattered``)."""

    parts: tuple[tuple[int, int], ...]  # (offset, size) of each chunk's bytes, none empty

    @property
    def offset(self) -> int:
        return self.parts[0][0] if self.parts else 0

    @property
    def span(self) -> tuple[int, int]:
        if not self.parts:
            return (0, 0)
        return self.parts[0][0], self.parts[-1][0] + self.parts[-1][1] - self.parts[0][0]

    def read_into(self, read: Read, begin: int, view: memoryview) -> None:
        at, filled = 0, 0
        for offset, size in self.parts:
            first, last = max(begin + filled, at), min(begin + len(view), at + size)
            if first < last:
                view[filled : filled + last - first] = read(offset + first - at, last - first, None, (offset, size))
                filled += last - first
            at += size

    def layout(self, limit: int) -> tuple[Rows | bytes, ...] | str:
        if len(self.parts) > limit:
            return f"it has more than {limit} chunks"
        return (Rows(1, tuple((None, offset, size, size) for offset, size in self.parts)),) if self.parts else ()


@dataclass(frozen=True, slots=True)
class FlaxEntry(TensorEntry):
    """A tensor of a Flax checkpoint (``begin``/``end`` absolute, ``data_start`` 0): one range, or ``chunks``."""

    chunks: Chunks | None = None

    @property
    def scattered(self) -> Chunks | None:
        return self.chunks


def _entry(name: str, ext: Ext) -> FlaxEntry:
    array = array_of(ext, name)
    dtype = DTYPES[array.dtype][0]
    return FlaxEntry(name, dtype, array.shape, array.start, array.start + array.size)


def _chunked(path: str, name: str, value: dict[str, Any]) -> FlaxEntry:
    """A ``__msgpack_chunked_array__`` map as ``_unchunk`` reads it: ``shape`` and ``chunks`` maps keyed 0, 1, ..."""
    shape, chunks = value.get("shape"), value.get("chunks")
    if not isinstance(shape, dict) or not isinstance(chunks, dict):
        raise InvalidChunkedArray(path, "it has no shape and chunks maps", name)
    if list(shape) != [str(i) for i in range(len(shape))] or list(chunks) != [str(i) for i in range(len(chunks))]:
        raise InvalidChunkedArray(path, "its shape and chunks are not keyed 0, 1, ... in order", name)
    dims = list(shape.values())
    if not all(type(n) is int and n >= 0 for n in dims):
        raise InvalidChunkedArray(path, f"its shape {dims!r:.60} is not of non-negative integers", name)
    arrays = []
    for key, chunk in chunks.items():
        if not isinstance(chunk, Ext) or chunk.code != ARRAY:
            raise InvalidChunkedArray(path, f"its chunk {key} is not an array", name)
        arrays.append(array_of(chunk, f"{name} (chunk {key})"))
    if not arrays or any(len(a.shape) != 1 or a.dtype != arrays[0].dtype for a in arrays):
        raise InvalidChunkedArray(path, "its chunks are not flat arrays of one dtype", name)
    count = sum(a.shape[0] for a in arrays)
    if count != math.prod(dims):
        raise InvalidChunkedArray(
            path, f"its chunks hold {count} values, its shape {dims} needs {math.prod(dims)}", name
        )
    parts = tuple((a.start, a.size) for a in arrays if a.size)
    nbytes = sum(size for _, size in parts)
    begin = parts[0][0] if parts else arrays[0].start
    gathered = Chunks(parts) if len(parts) > 1 else None
    return FlaxEntry(name, DTYPES[arrays[0].dtype][0], tuple(dims), begin, begin + nbytes, gathered)


def _walk(
    path: str, tree: dict[str, Any], prefix: str, tensors: list[FlaxEntry], plain: dict[str, str], listed: bool = False
) -> None:
    """Each array of ``tree`` a tensor and each plain value a metadata entry, named by their path of keys; ``listed``:
    within a list, where flax's reader leaves a chunked array's map as it is (it looks for them in maps of maps)."""
    for key, value in tree.items():
        name = prefix + key.replace("/", ".")
        if isinstance(value, dict) and CHUNKED in value and not listed:
            tensors.append(_chunked(path, name, value))
        elif isinstance(value, dict):
            _walk(path, value, name + ".", tensors, plain, listed)
        elif isinstance(value, list) and any(_holds_ext(item) for item in value):
            _walk(path, {str(i): item for i, item in enumerate(value)}, name + ".", tensors, plain, True)
        elif isinstance(value, Ext) and value.code in (ARRAY, SCALAR):
            tensors.append(_entry(name, value))
        elif isinstance(value, Ext) and value.code == COMPLEX:
            plain[name] = json.dumps(_plain(value.pair))
        elif isinstance(value, Ext):
            raise InvalidMsgpack(path, f"ext type {value.code} at byte {value.start}, which flax does not write", name)
        else:
            plain[name] = value if isinstance(value, str) else json.dumps(_plain(value))


def _holds_ext(value: Any) -> bool:
    if isinstance(value, Ext):
        return True
    if isinstance(value, dict):
        return any(_holds_ext(item) for item in value.values())
    return isinstance(value, list) and any(_holds_ext(item) for item in value)


def _plain(value: Any) -> Any:
    """A plain value as JSON can hold it (a bin as hex)."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def fetch_header(fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0) -> Header:
    """Read and validate the Flax checkpoint ``path`` through ``fetch`` as a ``Header``: a tensor for each array (a
    range of the file, or its chunks gathered), its plain values and ``format`` ``flax`` as metadata."""
    framing = Framing(fetch, path, file_size, max(first_read, WINDOW))
    if file_size == 0:
        raise NotFlax(path, "the file is empty")
    top = framing.value()
    if framing.pos != file_size:  # msgpack.unpackb refuses trailing bytes (ExtraData)
        raise InvalidMsgpack(path, f"its msgpack value ends at byte {framing.pos}, the file at {file_size}")
    if not isinstance(top, dict):
        raise NotFlax(path, f"its msgpack value is a {type(top).__name__}, not a map")
    if CHUNKED in top:  # flax's reader gives one array for the whole file, no state dict
        raise InvalidChunkedArray(path, "its top level is one chunked array, not a state dict")
    tensors: list[FlaxEntry] = []
    plain: dict[str, str] = {}
    _walk(path, top, "", tensors, plain)
    if not tensors:
        raise NotFlax(path, "its map holds no array")
    seen: set[str] = set()
    for entry in tensors:
        if entry.name in seen:  # "a/b" and "a.b", or a key holding "." beside a map
            raise InvalidMsgpack(path, "two of its arrays have one name", entry.name)
        seen.add(entry.name)
    metadata = {"format": "flax", **plain}
    return made_header(
        path=path,
        file_size=file_size,
        mtime_ns=mtime_ns,
        tensors=tensors,
        metadata=metadata,
    )


class _Flax(Format):
    name = "flax"
    title = "Flax msgpack"
    head_size = 2

    def sniff(self, head: bytes) -> bool:
        """A msgpack map whose first key is a string (a pickle's ``\\x80`` is followed by its protocol number)."""
        return (
            len(head) == 2
            and (0x81 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF))
            and (0xA0 <= head[1] <= 0xBF or head[1] in (0xD9, 0xDA, 0xDB) or head[0] in (0xDE, 0xDF))
        )

    def read_header(
        self, fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0
    ) -> Header:
        return fetch_header(fetch, path=path, file_size=file_size, mtime_ns=mtime_ns, first_read=first_read)

    def index_name(self, name: str) -> str:
        """A tensor as transformers' ``weight_map`` names it (its keys joined by ``/``) as stfs names it."""
        return name.replace("/", ".")

    def safetensors_names(self, path: str) -> tuple[str, ...]:
        """``flax_model.msgpack`` -> ``model.safetensors`` where the folder has none, else ``flax_model.safetensors``
        (its shards and index alike); any other ``x.msgpack`` -> ``x.safetensors``."""
        folder, _, name = path.rpartition("/")
        own = name.replace(".msgpack", ".safetensors", 1)
        names: tuple[str, ...] = (own,)
        if name.startswith("flax_model"):
            names = ("model" + own[len("flax_model") :], own)
        return tuple(f"{folder}/{each}" if folder else each for each in names)

    def safetensors_name(self, path: str) -> str | None:
        return self.safetensors_names(path)[0]


FORMAT: Format = _Flax()
