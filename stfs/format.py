"""The safetensors file format: read a header and enforce every validation rule (README.md, "Validation").

Pure: a header comes through a range fetcher (``fetch(offset, size) -> bytes``), in one or two
reads (the 8-byte length, then the JSON header), never the data section; no I/O of its own.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from . import errors

MAX_HEADER_LENGTH = 100_000_000
RangeFetcher = Callable[[int, int], bytes]  # (offset, size) -> bytes, short only at the end of the file
U64_MAX = 2**64 - 1

# The 22 dtypes of safetensors 0.8 and their widths in bits.
DTYPE_BITS: Mapping[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a header; ``begin``/``end`` are relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.begin

    @property
    def parameters(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Header:
    """A validated safetensors header of the file at ``path``."""

    path: str
    header_length: int
    json_length: int  # header bytes less trailing padding
    file_size: int
    mtime_ns: int
    tensors: tuple[TensorEntry, ...]  # in the order the header lists them
    metadata: Mapping[str, str]
    digest: bytes  # of the header bytes: tells two headers apart (diagnostics)

    @property
    def data_start(self) -> int:
        return 8 + self.header_length

    @property
    def data_size(self) -> int:
        return self.file_size - self.data_start


def fetch_header(fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 8) -> Header:
    """Read and validate the header of the ``file_size``-byte file ``path`` through ``fetch(offset, size)``.

    The first fetch asks for ``first_read`` bytes from 0 (at least the 8 of the length): where a remote
    file's header fits in a speculative first read, a header costs one request, else two.
    """
    if file_size < 8:
        raise errors.HeaderTooSmall(path, f"file is {file_size} bytes, fewer than the 8 of the length prefix")
    head = fetch(0, min(max(8, first_read), file_size))
    if len(head) < 8:
        raise errors.InvalidHeaderLength(path, f"file ended after {len(head)} bytes, inside the length prefix")
    (length,) = struct.unpack("<Q", head[:8])
    if length > MAX_HEADER_LENGTH:
        raise errors.HeaderTooLarge(path, f"header length {length} exceeds the limit of {MAX_HEADER_LENGTH}")
    if 8 + length > file_size:
        raise errors.InvalidHeaderLength(path, f"header length {length} runs past the end of the {file_size}-byte file")
    raw = head[8 : 8 + length] if len(head) >= 8 + length else fetch(8, length)
    if len(raw) < length:
        raise errors.InvalidHeaderLength(path, f"file ended after {8 + len(raw)} bytes, inside the header")
    return parse_header(bytes(raw), path=path, file_size=file_size, mtime_ns=mtime_ns)


def parse_header(raw: bytes, *, path: str, file_size: int, mtime_ns: int = 0) -> Header:
    """Validate header bytes ``raw`` (without the length prefix) of a ``file_size``-byte file."""
    if 8 + len(raw) > file_size:
        raise errors.InvalidHeaderLength(
            path, f"header length {len(raw)} runs past the end of the {file_size}-byte file"
        )
    if not raw.startswith(b"{"):
        raise errors.InvalidHeaderStart(path, "header does not begin with '{'")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise errors.InvalidHeaderUtf8(path, f"header is not UTF-8 (byte {exc.start})") from exc
    document = _load_plain(raw, text)
    if document is None:  # a duplicate key, an escape, a negative number...: the exact (slower) parse decides
        document = _load_json(text, path)
    if not isinstance(document, dict):
        raise errors.InvalidHeaderDeserialization(path, "header is not a JSON object")
    metadata = _check_metadata(document.pop("__metadata__", None), path)
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
    entries = tuple(_check_tensor(name, info, path, shapes) for name, info in document.items())
    _check_layout(entries, path, data_size=file_size - 8 - len(raw))
    return Header(
        path=path,
        header_length=len(raw),
        json_length=len(raw.rstrip(b" ")),
        file_size=file_size,
        mtime_ns=mtime_ns,
        tensors=entries,
        metadata=metadata,
        digest=header_digest(raw),
    )


_ENTRY_SETTERS = tuple(TensorEntry.__dict__[field].__set__ for field in ("name", "dtype", "shape", "begin", "end"))
_NEGATIVE = re.compile(rb"[:\[,][ \t\n\r]*-")  # a negative number: never valid, left to the exact parse
_DTYPE_NAMES = {name: name for name in DTYPE_BITS}  # one shared str per dtype, whatever the header spelled


def _load_plain(raw: bytes, text: str) -> dict[str, Any] | None:
    """The header parsed without a duplicate-key hook (twice as fast), when that provably loses nothing.

    ``None`` when the exact parse must decide. A plain ``json.loads`` keeps only the last of duplicate
    keys, so duplicates are found by counting: every ``:`` outside a string introduces one member of an
    object, so without escapes (which could spell a ``:``) the colons of the text equal the members
    parsed plus the colons inside parsed strings exactly when no key was repeated. Values this count
    does not look into (nested objects) can only make it fall short, never hide a duplicate.
    """
    if b"\\" in raw or _NEGATIVE.search(raw):  # escapes; "-0", which the reference reads as a float
        return None
    if not _INT_DIGITS_LIMITED:  # int() of a huge digit run would be quadratic: only _json guards it
        return None
    try:
        document = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    if type(document) is not dict:
        return None
    members = len(document)
    in_strings = "".join(document).count(":")
    for info in document.values():
        if type(info) is dict:
            members += len(info)
            in_strings += "".join(info).count(":")
            for value in info.values():
                if type(value) is str:
                    in_strings += value.count(":")
    return document if members + in_strings == raw.count(b":") else None


def header_digest(raw: bytes) -> bytes:
    """A short digest of header bytes, compared to tell whether a file still has the header it was mounted with."""
    return hashlib.blake2b(raw, digest_size=16).digest()


class _Object(dict):
    """A parsed JSON object that remembers its first duplicate key (the parse goes on, to say where it is)."""

    duplicate: str | None = None


def _object_or_raise(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise _DuplicateKey()
    return result


def _object_marked(pairs: list[tuple[str, Any]]) -> _Object:
    result = _Object(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                result.duplicate = key
                break
            seen.add(key)
    return result


class _DuplicateKey(Exception):
    pass


def _parse_int(literal: str) -> int | float:
    # As serde_json does for the reference: "-0" and integers beyond 64 bits are floats, so never a shape or an
    # offset; this also keeps int() away from 100 MB digit strings, whose conversion is quadratic.
    if literal == "-0" or len(literal) > 20:
        return float(literal)
    return int(literal)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Only a \uD800-\uDFFF escape can put a surrogate into a parsed string (the UTF-8 decoder refuses encoded ones).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# Without a limit on int() digits (Python 3.10, or PYTHONINTMAXSTRDIGITS=0) every integer goes through _parse_int.
_INT_DIGITS_LIMITED = getattr(sys, "get_int_max_str_digits", lambda: 0)() > 0


def _json(text: str, hook: Any) -> Any:
    # _parse_int costs a Python call per integer, so it is used only when an integer might need it.
    careful = "-0" in text or not _INT_DIGITS_LIMITED
    try:
        return json.loads(
            text, object_pairs_hook=hook, parse_constant=_reject_constant, parse_int=_parse_int if careful else None
        )
    except ValueError as exc:
        if careful or "integer string conversion" not in str(exc):
            raise
    return json.loads(text, object_pairs_hook=hook, parse_constant=_reject_constant, parse_int=_parse_int)


def _load_json(text: str, path: str) -> Any:
    try:
        try:
            document = _json(text, _object_or_raise)
        except _DuplicateKey:
            document = _json(text, _object_marked)
            raise _duplicate_error(document, path) from None
    except RecursionError:
        raise errors.InvalidHeaderDeserialization(path, "JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, or an integer too long to convert
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise errors.InvalidHeaderDeserialization(path, f"invalid JSON: {detail}") from None
    if _SURROGATE_ESCAPE.search(text):
        _reject_surrogates(document, path)
    return document


def _nested(value: Any) -> Iterator[Any]:
    """``value`` and every value inside it, without recursion (the document may be nested a thousand deep)."""
    stack = [value]
    while stack:
        item = stack.pop()
        yield item
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _first_duplicate(value: Any) -> str | None:
    return next((v.duplicate for v in _nested(value) if isinstance(v, _Object) and v.duplicate is not None), None)


def _duplicate_error(document: Any, path: str) -> errors.FormatError:
    """Name the tensor whose info holds the duplicate key, or the duplicated tensor name itself."""
    if isinstance(document, _Object):
        for name, value in document.items():
            inner = _first_duplicate(value)
            if inner is not None and name == "__metadata__":
                return errors.InvalidHeaderDeserialization(path, f"duplicate key {inner!r} in __metadata__")
            if inner is not None:
                return errors.InvalidHeaderDeserialization(path, f"duplicate key {inner!r}", name)
        if document.duplicate is not None:
            return errors.InvalidHeaderDeserialization(path, "tensor name appears twice", document.duplicate)
    return errors.InvalidHeaderDeserialization(path, f"duplicate key {_first_duplicate(document)!r}")


def _reject_surrogates(document: Any, path: str) -> None:
    # The reference (serde_json) refuses a lone surrogate anywhere; a name holding one could not be a file name.
    parts = document.items() if isinstance(document, dict) else [("__metadata__", document)]
    for name, value in parts:
        for item in _nested([name, value]):
            if isinstance(item, str) and not encodable(item):
                raise errors.InvalidHeaderDeserialization(
                    path, f"string {item!r:.60} holds a lone UTF-16 surrogate", None if name == "__metadata__" else name
                )


def encodable(text: str) -> bool:
    """Whether ``text`` is valid Unicode (a JSON ``\\uD800`` escape can make a str that is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_metadata(value: Any, path: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise errors.InvalidMetadata(path, "__metadata__ is not a JSON object")
    for key, item in value.items():
        if not isinstance(item, str):
            raise errors.InvalidMetadata(path, f"__metadata__ value of {key!r} is not a string")
    return value


def _is_u64(value: Any) -> bool:
    return type(value) is int and 0 <= value <= U64_MAX


def _check_tensor(name: str, info: Any, path: str, shapes: dict[tuple[int, ...], tuple[int, ...]]) -> TensorEntry:
    """Rules 7-9 for one tensor (and rule 10's begin <= end); ``shapes`` shares equal shape tuples."""
    if not isinstance(info, dict):
        raise errors.MalformedTensorInfo(path, "tensor info is not a JSON object", name)
    dtype = info.get("dtype")
    if type(dtype) is not str or dtype not in DTYPE_BITS:
        raise errors.MalformedTensorInfo(path, f"unknown dtype {_short(dtype)}", name)
    shape = info.get("shape")
    if type(shape) is not list:
        raise errors.MalformedTensorInfo(path, f"shape {_short(shape)} is not a list of non-negative integers", name)
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= U64_MAX:
            raise errors.MalformedTensorInfo(
                path, f"shape {_short(shape)} is not a list of non-negative integers", name
            )
    offsets = info.get("data_offsets")
    if type(offsets) is not list or len(offsets) != 2 or not (_is_u64(offsets[0]) and _is_u64(offsets[1])):
        raise errors.MalformedTensorInfo(path, f"data_offsets {_short(offsets)} is not two non-negative integers", name)
    begin, end = offsets

    elements = 1
    for dim in shape:
        elements *= dim
        if elements > U64_MAX:
            raise errors.ValidationOverflow(path, f"element count of shape {_short(shape)} overflows 64 bits", name)
    bits = elements * DTYPE_BITS[dtype]
    if bits > U64_MAX:
        raise errors.ValidationOverflow(path, f"bit count of {elements} x {dtype} overflows 64 bits", name)
    if bits % 8:
        raise errors.MisalignedSlice(path, f"{elements} elements of {dtype} are {bits} bits, not whole bytes", name)
    if begin > end:
        raise errors.InvalidOffset(path, f"data_offsets [{begin}, {end}] end before they begin", name)
    if end - begin != bits // 8:
        raise errors.TensorInvalidInfo(
            path, f"data_offsets span {end - begin} bytes but {dtype} {_short(list(shape))} needs {bits // 8}", name
        )
    # A frozen dataclass's __init__ sets each field through object.__setattr__; the slots' own setters
    # make the same record in two thirds of the time (one record per tensor of every header).
    entry = object.__new__(TensorEntry)
    set_name, set_dtype, set_shape, set_begin, set_end = _ENTRY_SETTERS
    key = tuple(shape)
    set_name(entry, name)
    set_dtype(entry, _DTYPE_NAMES[dtype])
    set_shape(entry, shapes.setdefault(key, key))
    set_begin(entry, begin)
    set_end(entry, end)
    return entry


def _check_layout(entries: tuple[TensorEntry, ...], path: str, data_size: int) -> None:
    """Rules 10-11: sorted by offset, the tensors tile the data section exactly."""
    position = 0
    for entry in entries:  # writers list tensors in offset order: then no sort is needed
        if entry.begin != position:
            break
        position = entry.end
    else:
        if position == data_size:
            return
    position = 0
    last: str | None = None
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.begin != position:
            kind = "gap before" if entry.begin > position else "overlap at"
            detail = f"{kind} data_offsets [{entry.begin}, {entry.end}]: previous tensor ends at {position}"
            raise errors.InvalidOffset(path, detail, entry.name)
        position = entry.end
        last = entry.name
    if position != data_size:
        raise errors.MetadataIncompleteBuffer(
            path, f"tensors end at byte {position} of the data but the data section is {data_size} bytes", last
        )


def _short(value: Any) -> str:
    if isinstance(value, list) and len(value) > 8:
        head = _short(value[:8])
        return head[:-1] + ", ...]" if head.endswith("]") else head
    try:
        text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    except RecursionError:  # parsed just below the limit, dumped a few frames deeper
        text = f"(a {type(value).__name__} nested too deeply)"
    return text if len(text) <= 60 else text[:57] + "..."
