"""A GGUF header as text: metadata/ files and header.json in the safetensors schema."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .types import GgufHeader, GgufSplitSet, GgufTensor, GGUFValueType, KeyValue, StringArray

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
