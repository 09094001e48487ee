"""The safetensors file format: read a header and enforce every validation rule (docs/validation.md).

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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .. import errors
from .base import Format, Header, RangeFetcher, TensorEntry, encodable
from .dtypes import DTYPE_BITS

MAX_HEADER_LENGTH = 100_000_000
U64_MAX = 2**64 - 1


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
        # Without a "{" after them, the 8 bytes read as the length are no length at all: text, another format
        opening = (head[8:9] or fetch(8, 1)) if file_size > 8 else b""
        raise errors.HeaderTooLarge(
            path,
            f"header length {length} exceeds the limit of {MAX_HEADER_LENGTH}",
            first_bytes=None if opening == b"{" else bytes(head[:8]),
        )
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
    metadata_value = document.pop("__metadata__", None)
    try:
        metadata = _check_metadata(metadata_value, path)
        shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
        entries = tuple(_check_tensor(name, info, path, shapes) for name, info in document.items())
        _check_layout(entries, path, data_size=file_size - 8 - len(raw))
    except errors.FormatError:
        # The reference reads the whole JSON before it looks at a tensor: nesting or a number it refuses anywhere
        # is its verdict, whatever else is wrong. Checked here only, as a valid header's shape is known to pass.
        _check_json_limits([("__metadata__", metadata_value), *document.items()], path)
        raise
    return Header(
        path=path,
        file_size=file_size,
        mtime_ns=mtime_ns,
        tensors=entries,
        metadata=metadata,
        digest=header_digest(raw),
        data_start=8 + len(raw),
        json_at=(8, len(raw.rstrip(b" "))),  # trailing padding is not JSON
    )


_ENTRY_SETTERS = tuple(TensorEntry.__dict__[field].__set__ for field in ("name", "dtype", "shape", "begin", "end"))
_NEGATIVE = re.compile(rb"[:\[,][ \t\n\r]*-")  # a negative number: never valid, left to the exact parse
_DTYPE_NAMES = {name: name for name in DTYPE_BITS}  # one shared str per dtype, whatever the header spelled
_TENSOR_MEMBERS = frozenset(("dtype", "shape", "data_offsets"))


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
        document = _PLAIN_DECODER.decode(text)
    except (ValueError, RecursionError, _OutOfRange):
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


# -- JSON as the reference (serde_json) reads it ---------------------------------------------------------------------

MAX_NESTING = 127  # serde_json refuses a 128th container nested in the others (the header's own object counts)
_TOO_DEEP = f"containers nest more than {MAX_NESTING} deep, the reference's limit"
_U64_DIGITS = len(str(U64_MAX))
_I32_MAX = 2**31 - 1
_POW10 = tuple(float(f"1e{k}") for k in range(309))  # serde_json's table: correctly rounded literals 1e0..1e308
_SMALL_ENOUGH = 10**308  # an integer below this has at most 308 digits, which serde_json never finds out of range
_LONG_INTEGER = re.compile(r"[0-9]{309}")
_NUMBER = re.compile(r"-?([0-9]+)(?:\.([0-9]+))?(?:[eE]([+-]?)([0-9]+))?")


def reference_number(literal: str) -> float | None:
    """The float64 serde_json makes of a JSON number ``literal``, or ``None`` where it says "number out of range".

    Not a correctly rounded parse (serde_json's default, without ``float_roundtrip``): it keeps the leading digits
    that fit in a u64, drops the others (an integer part's still count in the exponent), and multiplies or
    divides by one power of ten from its table, refusing an infinite product. So its largest number is below
    float64's: ``1.7976931348623158e308``, which Python rounds to the largest float, is out of range.
    """
    match = _NUMBER.fullmatch(literal)
    if match is None:
        raise ValueError(f"not a JSON number: {literal[:40]!r}")
    integer, fraction, exponent_sign, exponent_digits = match.groups()
    significand, taken = _take_digits(0, integer)
    exponent = len(integer) - taken
    if fraction:
        significand, taken = _take_digits(significand, fraction)
        exponent -= taken
    if exponent_digits is not None:
        digits = exponent_digits.lstrip("0") or "0"
        value = int(digits) if len(digits) <= 10 else _I32_MAX + 1  # int() of a long run would be refused
        if value > _I32_MAX:  # serde_json gives up on an exponent beyond i32
            if significand != 0 and exponent_sign != "-":
                return None
            return -0.0 if literal.startswith("-") else 0.0
        exponent = exponent - value if exponent_sign == "-" else exponent + value
        exponent = max(-_I32_MAX - 1, min(_I32_MAX, exponent))  # saturating, as serde_json adds
    result = float(significand)
    while True:
        if abs(exponent) < len(_POW10):
            if exponent >= 0:
                result *= _POW10[exponent]
                if math.isinf(result):
                    return None
            else:
                result /= _POW10[-exponent]
            break
        if result == 0.0:
            break
        if exponent >= 0:
            return None
        result /= 1e308
        exponent += 308
    return -result if literal.startswith("-") else result


def _take_digits(significand: int, digits: str) -> tuple[int, int]:
    """``significand`` with the leading ``digits`` appended while it fits in a u64, and how many were taken."""
    zeros = 0
    if significand == 0:  # zeros after "0." keep it 0: a run of them is taken whole (it may be 100 MB long)
        zeros = len(digits) - len(digits.lstrip("0"))
        digits = digits[zeros:]
    taken = 0
    for digit in digits[: _U64_DIGITS + 1]:
        grown = significand * 10 + ord(digit) - 48
        if grown > U64_MAX:
            break
        significand = grown
        taken += 1
    return significand, zeros + taken


class _OutOfRange(Exception):
    """A number literal the reference refuses, met while parsing (the exact parse then marks where it is)."""


@dataclass(frozen=True, slots=True)
class _RefusedNumber:
    """Stands in the parsed document for a number literal the reference refuses, to find the tensor it is in."""

    literal: str


def _number(literal: str) -> float:
    value = reference_number(literal)
    if value is None:
        raise _OutOfRange(literal)
    return value


def _number_marked(literal: str) -> float | _RefusedNumber:
    value = reference_number(literal)
    return _RefusedNumber(literal) if value is None else value


def _check_json_limits(members: Iterable[tuple[str, Any]], path: str) -> None:
    """Raise what the reference's parse would for these top-level members: nesting past 127, a number out of range.

    Numbers are ``_RefusedNumber`` marks, or Python ints of 309 digits or more (which the plain parse keeps).
    """
    for name, value in members:
        where = "in __metadata__: " if name == "__metadata__" else ""
        stack = [(value, 2)]
        while stack:
            item, depth = stack.pop()
            kind = type(item)
            if kind is dict or kind is list or kind is _Object:
                if depth > MAX_NESTING:
                    raise errors.RecursionLimitExceeded(path, f"{where}{_TOO_DEEP}", _tensor(name))
                inside = item if kind is list else item.values() if kind is dict else (v for _, v in _members(item))
                stack.extend((inner, depth + 1) for inner in inside)
            elif kind is _RefusedNumber or (kind is int and abs(item) >= _SMALL_ENOUGH):
                literal = item.literal if kind is _RefusedNumber else str(item)
                if reference_number(literal) is None:
                    raise _out_of_range(path, literal, name)


def _reference_fault(path: str, text: str) -> errors.FormatError | None:
    """The nesting or number fault the reference meets in ``text`` before any syntax error, if there is one.

    Top-level members are parsed one by one, so the first member to fail is the one named.
    """
    long_integers = _LONG_INTEGER.search(text) is not None or not _INT_DIGITS_LIMITED
    decoder = json.JSONDecoder(
        parse_float=_number, parse_int=_parse_int if long_integers else None, parse_constant=_reject_constant
    )
    skip = re.compile(r"[ \t\n\r]*")
    index = skip.match(text, 1).end()  # type: ignore[union-attr]  # it matches the empty string at least
    try:
        while text.startswith('"', index):
            key, index = json.decoder.scanstring(text, index + 1)  # type: ignore[attr-defined]
            index = skip.match(text, skip.match(text, index).end() + 1).end()  # type: ignore[union-attr]
            try:
                value, index = decoder.scan_once(text, index)  # type: ignore[attr-defined]
            except _OutOfRange as exc:
                return _out_of_range(path, str(exc), key)
            except RecursionError:
                where = "in __metadata__: " if key == "__metadata__" else ""
                return errors.RecursionLimitExceeded(path, f"{where}{_TOO_DEEP}", _tensor(key))
            _check_json_limits([(key, value)], path)
            index = skip.match(text, index).end()  # type: ignore[union-attr]
            if not text.startswith(",", index):
                return None
            index = skip.match(text, index + 1).end()  # type: ignore[union-attr]
    except errors.FormatError as exc:
        return exc
    except (ValueError, StopIteration):
        return None
    return None


def _out_of_range(path: str, literal: str, name: str | None) -> errors.NumberOutOfRange:
    shown = literal if len(literal) <= 40 else f"{literal[:20]}...({len(literal)} characters)"
    where = "in __metadata__: " if name == "__metadata__" else ""
    return errors.NumberOutOfRange(path, f"{where}number {shown} is beyond float64", _tensor(name))


def _tensor(name: str | None) -> str | None:
    return None if name == "__metadata__" else name


class _Object(dict):
    """A parsed JSON object that remembers its first duplicate key (the parse goes on, to say where it is)."""

    duplicate: str | None = None
    pairs: list[tuple[str, Any]] | None = None  # every member, where a duplicate hides one from the dict


def _members(value: _Object) -> list[tuple[str, Any]]:
    return value.pairs if value.pairs is not None else list(value.items())


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
                result.pairs = pairs
                break
            seen.add(key)
    return result


class _DuplicateKey(Exception):
    pass


def _parse_int(literal: str) -> int | float:
    # As serde_json does for the reference: "-0" and integers beyond 64 bits are floats, so never a shape or an
    # offset; this also keeps int() away from 100 MB digit strings, whose conversion is quadratic.
    if literal == "-0":
        return -0.0
    if len(literal) > _U64_DIGITS:
        return _number(literal)
    return int(literal)


def _parse_int_marked(literal: str) -> int | float | _RefusedNumber:
    if literal == "-0" or len(literal) <= _U64_DIGITS:
        return _parse_int(literal)
    return _number_marked(literal)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Only a \uD800-\uDFFF escape can put a surrogate into a parsed string (the UTF-8 decoder refuses encoded ones).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# Without a limit on int() digits (Python 3.10, or PYTHONINTMAXSTRDIGITS=0) every integer goes through _parse_int.
_INT_DIGITS_LIMITED = getattr(sys, "get_int_max_str_digits", lambda: 0)() > 0
_PLAIN_DECODER = json.JSONDecoder(parse_float=_number, parse_constant=_reject_constant)


def _json(text: str, hook: Any, marked: bool = False) -> Any:
    # _parse_int costs a Python call per integer, so it is used only when an integer might need it.
    careful = "-0" in text or not _INT_DIGITS_LIMITED
    parse_int = _parse_int_marked if marked else _parse_int
    parse_float = _number_marked if marked else _number
    try:
        return json.loads(
            text,
            object_pairs_hook=hook,
            parse_constant=_reject_constant,
            parse_float=parse_float,
            parse_int=parse_int if careful else None,
        )
    except ValueError as exc:
        if careful or "integer string conversion" not in str(exc):
            raise
    return json.loads(
        text, object_pairs_hook=hook, parse_constant=_reject_constant, parse_float=parse_float, parse_int=parse_int
    )


def _load_json(text: str, path: str) -> Any:
    try:
        try:
            document = _json(text, _object_or_raise)
        except _DuplicateKey:
            document = _json(text, _object_marked, marked=True)
            if isinstance(document, _Object):  # what the reference refuses too is said first
                _check_json_limits(_members(document), path)
            raise _duplicate_error(document, path) from None
    except _OutOfRange as exc:  # met before any syntax error, as the reference meets it
        raise _reference_fault(path, text) or _out_of_range(path, str(exc), None) from None
    except RecursionError:
        raise _reference_fault(path, text) or errors.RecursionLimitExceeded(path, _TOO_DEEP) from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, or an integer too long to convert
        # Nesting of 128 to Python's limit, or an integer of 309 digits or more, parse here: the reference refuses them
        # where they stand, before a later syntax error.
        fault = _reference_fault(path, text)
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise fault or errors.InvalidHeaderDeserialization(path, f"invalid JSON: {detail}") from None
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
    """Name what is duplicated: a key inside a tensor's info or ``__metadata__``, a tensor name, ``__metadata__``."""
    if isinstance(document, _Object):
        for name, value in document.items():
            inner = _first_duplicate(value)
            if inner is not None and name == "__metadata__":
                return errors.DuplicateKey(path, f"key {inner!r} appears twice in __metadata__")
            if inner is not None:
                return errors.DuplicateKey(path, f"key {inner!r} appears twice in the tensor's info", name)
        if document.duplicate == "__metadata__":
            return errors.DuplicateKey(path, "__metadata__ appears twice")
        if document.duplicate is not None:
            return errors.DuplicateKey(path, "tensor name appears twice", document.duplicate)
    return errors.DuplicateKey(path, f"key {_first_duplicate(document)!r} appears twice")


def _reject_surrogates(document: Any, path: str) -> None:
    # The reference (serde_json) refuses a lone surrogate anywhere; a name holding one could not be a file name.
    parts = document.items() if isinstance(document, dict) else [("__metadata__", document)]
    for name, value in parts:
        for item in _nested([name, value]):
            if isinstance(item, str) and not encodable(item):
                raise errors.InvalidHeaderDeserialization(
                    path, f"string {item!r:.60} holds a lone UTF-16 surrogate", None if name == "__metadata__" else name
                )


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
    if len(info) > len(_TENSOR_MEMBERS):  # members the reference ignores, but still parses
        _check_json_limits([(name, {k: v for k, v in info.items() if k not in _TENSOR_MEMBERS})], path)
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


class _Safetensors(Format):
    name = "safetensors"
    title = "safetensors"
    head_size = 9

    def sniff(self, head: bytes) -> bool:
        """An 8-byte header length within the limit, then the header's ``{``."""
        return len(head) >= 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] <= MAX_HEADER_LENGTH

    def read_header(
        self, fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0
    ) -> Header:
        return fetch_header(fetch, path=path, file_size=file_size, mtime_ns=mtime_ns, first_read=first_read)


FORMAT: Format = _Safetensors()
