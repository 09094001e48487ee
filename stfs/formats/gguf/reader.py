"""Reading a GGUF header: llama.cpp's rules in the order its reader checks them; a vocabulary's string arrays
walked in numpy passes."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping

import numpy as np

from ..base import RangeFetcher
from .rules import (
    ArrayTooLong,
    BigEndianFile,
    DataSectionOutOfFile,
    DuplicateKvKey,
    DuplicateTensorName,
    EmptyKey,
    GgufOverflow,
    GgufTruncated,
    InvalidAlignment,
    InvalidCount,
    InvalidDimensions,
    InvalidKvType,
    InvalidMagic,
    ObsoleteVersion,
    RowNotBlockMultiple,
    StringTooLong,
    TensorNameTooLong,
    TensorOffsetMismatch,
    TensorOutOfFile,
    UnknownGgmlType,
    UnsupportedVersion,
)
from .types import (
    _I32,
    _I64,
    _MIN_KV,
    _MIN_TENSOR_INFO,
    _SCALARS,
    _U32,
    _U64,
    ALIGNMENT_KEY,
    DEFAULT_ALIGNMENT,
    FIRST_READ,
    GGML_TYPES,
    INT64_MAX,
    MAGIC,
    MAX_ARRAY_ELEMENTS,
    MAX_DIMS,
    MAX_NAME,
    MAX_STRING_LENGTH,
    SIZE_MAX,
    GgmlType,
    GgufHeader,
    GgufTensor,
    GGUFValueType,
    HeaderIncomplete,
    KeyValue,
    KvValue,
    StringArray,
)


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
                raise GgufTruncated(
                    path, f"the file ended after {len(have)} bytes, short of the {file_size} its size says"
                )
        try:
            return parse_header(have, file_size=file_size, path=path)
        except HeaderIncomplete as more:
            want = min(file_size, max(2 * len(have), 2 * more.need) + FIRST_READ)


def parse_header(buf: bytes, *, file_size: int, path: str) -> GgufHeader:
    """Validate the header in ``buf``, the first bytes of the ``file_size``-byte file ``path``.

    Raises ``HeaderIncomplete`` when ``buf`` ends inside the header (and is shorter than the file), else the
    ``GgufError`` of the first rule the file breaks, in llama.cpp's order.
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
            raise GgufTruncated(
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
            raise StringTooLong(self.path, f"{what} is {length} bytes, over the 1 GiB limit", tensor)
        if length > self.file_size - self.pos:
            raise StringTooLong(
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
            raise InvalidMagic(path, f"the file starts with {magic!r}, not {MAGIC!r}")
        self.pos = 4
        version = self._version()
        n_tensors = self._int(_I64, "the tensor count")
        if n_tensors < 0:
            raise InvalidCount(path, f"tensor count {n_tensors} is negative (as llama.cpp's i64)")
        n_kv = self._int(_I64, "the key/value count")
        if n_kv < 0:
            raise InvalidCount(path, f"key/value count {n_kv} is negative (as llama.cpp's i64)")
        left = self.file_size - self.pos
        if n_kv * _MIN_KV > left:
            raise InvalidCount(
                path, f"{n_kv} key/values need at least {n_kv * _MIN_KV} bytes, the file has {left} left"
            )
        if n_kv * _MIN_KV + n_tensors * _MIN_TENSOR_INFO > left:
            raise InvalidCount(
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
            raise DataSectionOutOfFile(
                path,
                f"the data section would start at byte {data_offset}, past the end of the {self.file_size}-byte file",
            )
        tensors = self._offsets(tensors_read, alignment, data_offset)
        return GgufHeader(path, version, self.file_size, alignment, header_size, data_offset, metadata, tensors)

    def _version(self) -> int:
        version = self._int(_U32, "the version")
        if version == 0:
            raise UnsupportedVersion(self.path, "version 0 is not a GGUF version")
        if version & 0xFFFF == 0:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            raise BigEndianFile(
                self.path, f"the version reads {version:#010x}: a big-endian file (version {swapped} byte-swapped)"
            )
        if version == 1:
            raise ObsoleteVersion(self.path, "version 1 is obsolete (llama.cpp reads versions 2 and 3)")
        if version > 3:
            raise UnsupportedVersion(self.path, f"version {version} is newer than 3, the latest llama.cpp reads")
        return version

    def _key_values(self, count: int) -> dict[str, KeyValue]:
        found: dict[str, KeyValue] = {}
        for i in range(count):
            self.kv_left = count - i - 1
            key = self._string(f"key {i}")
            if not key:
                raise EmptyKey(self.path, f"key {i} is empty")
            if key in found:
                raise DuplicateKvKey(self.path, f"key {key!r} appears twice (key {i})")
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
            raise InvalidKvType(self.path, f"key {key!r} has type {kind}, not one of GGUF's 0-12")
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
            raise InvalidKvType(self.path, f"key {key!r} is an array of arrays, which llama.cpp does not read")
        if item != GGUFValueType.STRING and item not in _SCALARS:
            raise InvalidKvType(self.path, f"key {key!r} is an array of type {item}, not one of GGUF's 0-12")
        if length > MAX_ARRAY_ELEMENTS:
            raise ArrayTooLong(self.path, f"key {key!r} has {length} elements, over the limit of 2^30")
        item_size = 8 if item == GGUFValueType.STRING else _SCALARS[item][1]
        left = self.file_size - self.pos
        if length * item_size > left:
            raise ArrayTooLong(
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
            raise InvalidAlignment(self.path, f"{ALIGNMENT_KEY!r} is of type {found.type_name}, not u32")
        alignment = found.value
        assert isinstance(alignment, int)
        if alignment == 0 or alignment & (alignment - 1):
            raise InvalidAlignment(self.path, f"{ALIGNMENT_KEY!r} is {alignment}, not a power of two")
        return alignment

    def _tensor_infos(self, count: int) -> list[tuple[str, GgmlType, tuple[int, ...], int]]:
        infos: list[tuple[str, GgmlType, tuple[int, ...], int]] = []
        seen: set[bytes] = set()
        for i in range(count):
            self.tensors_left = count - i - 1
            raw = self._string_bytes(f"the name of tensor {i}")
            name = raw.decode("utf-8", "surrogateescape")
            if len(raw) >= MAX_NAME:
                raise TensorNameTooLong(self.path, f"the name is {len(raw)} bytes, not under {MAX_NAME}", name)
            c_name = raw.split(b"\0", 1)[0]  # ggml keeps a name as a C string
            if c_name in seen:
                raise DuplicateTensorName(self.path, f"tensor {i} repeats the name of an earlier one", name)
            seen.add(c_name)
            n_dims = self._int(_U32, f"the dimension count of tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:  # llama.cpp refuses more than 4; SPEC §11 a tensor without any too
                raise InvalidDimensions(self.path, f"{n_dims} dimensions, not 1 to {MAX_DIMS}", name)
            dims: tuple[int, ...] = ()
            for j in range(n_dims):
                extent = self._int(_I64, f"dimension {j} of tensor {name!r}")
                if extent < 0:
                    raise InvalidDimensions(self.path, f"dimension {j} is {extent}, negative", name)
                dims += (extent,)
            ne = dims + (1,) * (MAX_DIMS - n_dims)
            if math.prod(ne) > 0 and (
                INT64_MAX // ne[1] <= ne[0]
                or INT64_MAX // ne[2] <= ne[0] * ne[1]
                or INT64_MAX // ne[3] <= ne[0] * ne[1] * ne[2]
            ):
                raise GgufOverflow(self.path, f"dimensions {list(dims)} hold 2^63 - 1 elements or more", name)
            type_id = self._int(_I32, f"the type of tensor {name!r}")
            kind = GGML_TYPES.get(type_id)
            if kind is None:
                raise UnknownGgmlType(self.path, f"type {type_id} is not a GGML type gguf 0.19 knows", name)
            if ne[0] % kind.block_size:
                raise RowNotBlockMultiple(
                    self.path,
                    f"its first dimension {ne[0]} is not a multiple of {kind.name}'s block of {kind.block_size}",
                    name,
                )
            elements = math.prod(ne)
            if elements // kind.block_size > SIZE_MAX // kind.type_size:
                raise GgufOverflow(self.path, f"{elements} {kind.name} elements take 2^64 bytes or more", name)
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
                raise TensorOffsetMismatch(
                    self.path,
                    f"offset {offset}, where the padded sizes of the tensors before it add up to {expected}",
                    name,
                )
            nbytes = kind.nbytes(math.prod(dims))
            padded = _pad(nbytes, alignment)
            if expected + padded > SIZE_MAX:
                raise GgufOverflow(self.path, f"the data section's size passes 2^64 at {nbytes} bytes", name)
            expected += padded
            tensors.append(GgufTensor(name, kind, dims, offset, nbytes, data_offset + offset))
        # llama.cpp's model loader: every tensor's bytes inside the file.
        for tensor in tensors:
            stop = tensor.file_offset + tensor.nbytes
            if stop > self.file_size:
                raise TensorOutOfFile(
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
