"""Attributes' values as JSON, as h5py gives them: numbers (arrays as nested lists), fixed-length and variable-length
strings (bytes decoded as UTF-8), booleans; a value of another type is named by its type instead."""

from __future__ import annotations

import json
import math
import struct
from typing import Any

from .heaps import GlobalHeap
from .io import Fields, Reader
from .messages import ENUM, FIXED, FLOAT, STRING, VLEN, Attribute, Datatype

MAX_SHOWN = 1 << 20  # bytes of one attribute's JSON kept in metadata/


def number_format(datatype: Datatype) -> str | None:
    """``struct``'s format of one integer or float of the datatype, or ``None`` (numpy is not imported for a
    header: it would cost ``stfs info`` more than reading the file)."""
    order = ">" if datatype.big else "<"
    if datatype.cls == FIXED and datatype.size in (1, 2, 4, 8):
        code = {1: "b", 2: "h", 4: "i", 8: "q"}[datatype.size]
        return order + (code if datatype.signed else code.upper())
    if datatype.cls == FLOAT and (datatype.size, datatype.exponent, datatype.mantissa) in (
        (2, 5, 10),
        (4, 8, 23),
        (8, 11, 52),
    ):
        return order + {2: "e", 4: "f", 8: "d"}[datatype.size]
    return None


def _nested(values: list[Any], shape: tuple[int, ...]) -> list[Any]:
    """``values`` (C order) as nested lists of ``shape``."""
    for length in reversed(shape[1:]):
        values = [values[i : i + length] for i in range(0, len(values), length)]
    return values


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def attribute_value(reader: Reader, heap: GlobalHeap, attribute: Attribute) -> Any:
    """The attribute's value as plain Python (a list for an array), as h5py reads it, strings decoded."""
    datatype, space, data = attribute.datatype, attribute.space, attribute.data
    if space.null:
        return None
    count = math.prod(space.shape)
    values: list[Any]
    numeric = number_format(datatype)
    if numeric is not None and len(data) >= count * datatype.size:
        values = [value for (value,) in struct.iter_unpack(numeric, data[: count * datatype.size])]
    elif (
        datatype.cls == ENUM
        and datatype.base is not None
        and sorted(n for n, _ in datatype.members) == ["FALSE", "TRUE"]
    ):
        values = [bool(b) for b in data[: count * datatype.size : datatype.size]]
    elif datatype.cls == STRING:
        size = datatype.size
        values = [
            _text(data[i * size : (i + 1) * size].rstrip(b"\0 " if datatype.padding == 2 else b"\0"))
            for i in range(count)
        ]
    elif datatype.cls == VLEN and datatype.vlen_string:
        values = []
        item = 4 + reader.offset_size + 4
        for i in range(count):
            reader.step()
            fields = Fields(reader, data, "a variable-length string", i * item)
            length, collection, index = fields.u32(), fields.address(), fields.u32()
            values.append(_text(heap.object(collection, index)[:length]) if length else "")
    else:
        return f"<{datatype.title} attribute>"
    if not space.shape:
        return values[0] if values else None
    return _nested(values, space.shape) if count else []


def attribute_json(reader: Reader, heap: GlobalHeap, attribute: Attribute) -> str:
    """The value as JSON text (NaN and infinities as JSON has no number for them: strings)."""
    value = attribute_value(reader, heap, attribute)
    text = json.dumps(_finite(value), ensure_ascii=False)
    return text if len(text) <= MAX_SHOWN else json.dumps(f"<{len(text)} bytes of JSON, not shown>")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def text_value(reader: Reader, heap: GlobalHeap, attribute: Attribute) -> str | None:
    """A string attribute's value (Keras' ``dtype``), else ``None``."""
    if attribute.datatype.cls not in (STRING, VLEN) or attribute.space.shape:
        return None
    value = attribute_value(reader, heap, attribute)
    return value if isinstance(value, str) else None


__all__ = ["VLEN", "attribute_json", "attribute_value", "number_format", "text_value"]
