"""ONNX models (SPEC §13): every initializer of the graph, of its subgraphs (the bodies of If, Loop, Scan) and every
``Constant`` node's tensor, each a tensor of its bytes in C order as onnx's ``numpy_helper.to_array`` gives them.

The file is one protobuf ``ModelProto``; a model with its weights inside holds them as ``raw_data`` fields of up to
2 GiB. So the messages are never read whole: this module follows protobuf's framing (a tag, a varint length) to find
each ``TensorProto`` and where its ``raw_data`` lies, reading a window at a time through the range fetcher and
passing over the payloads unread, and decodes the few fields it needs of the rest (a tensor's ``dims``,
``data_type``, ``name``, external data; the model's ``ir_version``, producers, opsets, ``metadata_props``) as
protobuf does: the last of a scalar written twice, repeated numbers packed or not, a field of another wire type than
its own passed over. The ``onnx`` package is not needed. A tensor's bytes are then one range of the model's file
(``raw_data``, or a ``float_data``/``double_data`` packed as one run, which is already the values' little-endian
bytes), one range of another file of its folder (external data, ``TensorEntry.file``), or, kept in other typed
fields (``int32_data`` for float16, ...), made at mount as ``numpy_helper.to_array`` makes them (``_typed_bytes``)
and held in memory (``Held``; a bounded total of them).

Refused in one line naming the file, the tensor and the rule (``OnnxError``): a truncated or malformed
protobuf, an unknown ``data_type``, negative ``dims``, bytes that are not ``dims`` times the type's size, external
data without a ``location`` or outside the model's folder; ``model`` then checks each external data file is there
and holds its tensors. A tensor of a type safetensors lacks (string, complex128, 2- and 4-bit integers) is left out
with a warning naming it, as is a tensor whose name an earlier one took.
"""

from __future__ import annotations

import math
import posixpath
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

from .. import errors
from .base import Format, Header, RangeFetcher, Read, Rows, TensorEntry, encodable, made_header
from .dtypes import DTYPE_BITS

# -- the rules, one error each (SPEC §13, docs/onnx.md) ----------------------------------------------------------------


class OnnxError(errors.RuleError):
    """An ONNX model is refused (SPEC §13): its protobuf is broken, or a tensor breaks a rule of onnx's reader.

    ``rule_text`` names the rule in a few words; the message names the file, the tensor where there is one, and why.
    """

    rule_text = "invalid ONNX model"
    format_name = "ONNX model"
    advice = "onnx.load refuses it too: export it again, or save it again with onnx.save_model"


class TruncatedProtobuf(OnnxError):
    """A field's length or a varint runs past the end of the message holding it, or of the file."""

    rule_text = "protobuf inside the file"
    advice = errors.CUT_SHORT


class InvalidProtobuf(OnnxError):
    """The bytes are not protobuf as onnx's messages are: a wire type or field number protobuf has not, a varint
    over 10 bytes, messages nested past protobuf's limit."""

    rule_text = "protobuf"


class UnknownDataType(OnnxError):
    """A tensor's ``data_type`` is not one of ``TensorProto.DataType`` (or is ``UNDEFINED``)."""

    rule_text = "known data_type"
    advice = "cast that initializer to a type safetensors has (FLOAT, FLOAT16, BFLOAT16, INT8, ...) and save it again"


class InvalidDims(OnnxError):
    """A tensor's ``dims`` hold a negative number, or their product overflows 64 bits."""

    rule_text = "dims"


class TensorLengthMismatch(OnnxError):
    """A tensor's bytes (``raw_data``, the ``length`` of its external data, the values of its typed field) are not
    its ``dims`` times its type's size."""

    rule_text = "length of dims x the type's size"


class InvalidExternalData(OnnxError):
    """A tensor whose ``data_location`` is ``EXTERNAL`` lacks a ``location``, or its ``offset`` or ``length`` is not
    a non-negative integer."""

    rule_text = "external data"
    advice = "keep its external data files beside it, as onnx.save_model(..., save_as_external_data=True) wrote them"


class LocationOutsideFolder(OnnxError):
    """An external data ``location`` is absolute, empty, or climbs out of the model's folder with ``..``."""

    rule_text = "external data inside the model's folder"


class TypedDataTooLarge(OnnxError):
    """The tensors a model keeps in typed fields (``int32_data``, ...) would need more than stfs holds in memory."""

    rule_text = "typed fields within bounds"
    advice = "save it with raw_data (onnx.numpy_helper.from_array does), or its large tensors as external data"


# Bytes read at once while walking the framing: a window after a jump over a payload, doubled while the walk reads
# on from where the last ended (the nodes of a large graph), up to the most. A payload past a window is not read.
WINDOW = 4 << 10
MAX_WINDOW = 1 << 20
MAX_NESTING = 100  # messages nested in each other: protobuf's default recursion limit, which onnx's parser keeps
HELD_LIMIT = 64 << 20  # bytes of tensors kept in typed fields that one model may hold in memory
U64_MAX = 2**64 - 1
PYTHON_VARINTS = 16 << 10  # bytes of varints decoded in Python; a longer run through numpy (imported then)
NUMPY_CHUNK = 1 << 20  # bytes of varints numpy decodes at once (8 bytes of each in its arrays)

# TensorProto.DataType, by value.
DATA_TYPES = (
    "UNDEFINED", "FLOAT", "UINT8", "INT8", "UINT16", "INT16", "INT32", "INT64", "STRING", "BOOL", "FLOAT16",
    "DOUBLE", "UINT32", "UINT64", "COMPLEX64", "COMPLEX128", "BFLOAT16", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ",
    "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "UINT4", "INT4", "FLOAT4E2M1", "FLOAT8E8M0", "UINT2", "INT2", "FLOAT6E2M3",
    "FLOAT6E3M2",
)  # fmt: skip
# ONNX's TensorProto.DataType -> safetensors' dtype. Not here, so left out: STRING (8), COMPLEX128 (15), UINT4 (21),
# INT4 (22), UINT2 (25), INT2 (26). FLOAT4E2M1 and FLOAT6 pack as safetensors' F4 and F6 do (element k at bits
# 4k or 6k of the little-endian bit stream), in raw_data as in safetensors.
DTYPES: dict[int, str] = {
    1: "F32",
    2: "U8",
    3: "I8",
    4: "U16",
    5: "I16",
    6: "I32",
    7: "I64",
    9: "BOOL",
    10: "F16",
    11: "F64",
    12: "U32",
    13: "U64",
    14: "C64",
    16: "BF16",
    17: "F8_E4M3",
    18: "F8_E4M3FNUZ",
    19: "F8_E5M2",
    20: "F8_E5M2FNUZ",
    23: "F4",
    24: "F8_E8M0",
    27: "F6_E2M3",
    28: "F6_E3M2",
}
FLOAT, INT32, INT64, STRING, DOUBLE, UINT32, UINT64, COMPLEX64, COMPLEX128 = 1, 6, 7, 8, 11, 12, 13, 14, 15
EXTERNAL = 1  # TensorProto.DataLocation
DATA_LOCATIONS = frozenset((0, EXTERNAL))  # a closed enum: another value is passed over, as protobuf does

# Fields of the messages, by number (onnx.proto3).
MODEL_IR_VERSION, MODEL_MODEL_VERSION, MODEL_GRAPH, MODEL_OPSET_IMPORT, MODEL_METADATA_PROPS = 1, 5, 7, 8, 14
MODEL_STRINGS = {2: "producer_name", 3: "producer_version", 4: "domain", 6: "doc_string"}
MODEL_FIELDS = ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string")
GRAPH_NODE, GRAPH_INITIALIZER, GRAPH_SPARSE_INITIALIZER = 1, 5, 15
NODE_OUTPUT, NODE_OP_TYPE, NODE_ATTRIBUTE, NODE_DOMAIN = 2, 4, 5, 7
ATTRIBUTE_NAME, ATTRIBUTE_T, ATTRIBUTE_G, ATTRIBUTE_GRAPHS, ATTRIBUTE_SPARSE_TENSOR = 1, 5, 6, 11, 22
SPARSE_VALUES = 1
TENSOR_DIMS, TENSOR_DATA_TYPE, TENSOR_SEGMENT, TENSOR_NAME, TENSOR_RAW_DATA = 1, 2, 3, 8, 9
TENSOR_EXTERNAL_DATA, TENSOR_DATA_LOCATION = 13, 14
ENTRY_KEY, ENTRY_VALUE = 1, 2  # StringStringEntryProto; OperatorSetIdProto: domain 1, version 2
# The typed fields: number -> (name, the wire type of one value: 0 a varint, 5 four bytes, 1 eight).
TYPED = {
    4: ("float_data", 5),
    5: ("int32_data", 0),
    7: ("int64_data", 0),
    10: ("double_data", 1),
    11: ("uint64_data", 0),
}
# The typed field each data_type is in (helper.tensor_dtype_to_field: its storage type's); int32_data for the rest.
TYPED_FIELD = {FLOAT: 4, COMPLEX64: 4, DOUBLE: 10, COMPLEX128: 10, INT64: 7, UINT32: 11, UINT64: 11, STRING: 6}
# Bytes a value of int32_data/int64_data/uint64_data keeps in to_array's array (the low ones: its casts wrap).
NARROWED = {INT32: 4, UINT32: 4, INT64: 8, UINT64: 8, 4: 2, 5: 2, 10: 2, 16: 2}  # UINT16 INT16 FLOAT16 BFLOAT16
F6 = frozenset((27, 28))  # int32_data's low six bits (to_array masks them), packed four in three bytes


class _Window:
    """The bytes of a file through a range fetcher, ``WINDOW`` at a time from where they are asked for: the framing
    of the fields walked is read, the payloads passed over never are."""

    def __init__(self, fetch: RangeFetcher, size: int, path: str, first_read: int) -> None:
        self.fetch = fetch
        self.size = size
        self.path = path
        self.window = max(WINDOW, first_read)  # the first: what the source would read of a header at once
        self.buffer = b""
        self.at = 0  # the file offset of buffer[0]

    def _load(self, offset: int, count: int) -> None:
        if self.buffer:
            on = offset == self.at + len(self.buffer)
            self.window = min(2 * self.window, MAX_WINDOW) if on else WINDOW
        self.buffer = self.fetch(offset, max(count, min(self.window, self.size - offset)))
        self.at = offset
        if len(self.buffer) < count:
            raise TruncatedProtobuf(self.path, f"the file ended at byte {offset + len(self.buffer)}")

    def get(self, offset: int, count: int) -> bytes:
        """The ``count`` bytes from ``offset`` (inside the file: the walk checked it)."""
        start = offset - self.at
        if start < 0 or start + count > len(self.buffer):
            self._load(offset, count)
            start = 0
        return self.buffer[start : start + count]

    def varint(self, offset: int, end: int) -> tuple[int, int]:
        """The varint at ``offset`` of a message that ends at ``end``, and where it ends."""
        if offset < self.at or self.at + len(self.buffer) < min(offset + 10, end):
            self._load(offset, min(10, end - offset))
        buffer = self.buffer
        index = offset - self.at
        limit = min(len(buffer), end - self.at)
        value = shift = 0
        while index < limit:
            byte = buffer[index]
            index += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value, self.at + index
            shift += 7
            if shift >= 70:
                raise InvalidProtobuf(self.path, f"the varint at byte {offset} is longer than 10 bytes")
        raise TruncatedProtobuf(self.path, f"the varint at byte {offset} runs past the end of its message")


@dataclass(slots=True)
class _Found:
    """A ``TensorProto`` as the walk found it: the fields decoded (as protobuf does: the last of a scalar written
    twice, a field of another wire type passed over), where its ``raw_data`` is, where each typed field's values
    are, and the name of the ``Constant`` whose value it is."""

    start: int
    output: str | None
    name: str = ""
    dims: list[int] = field(default_factory=list)
    data_type: int | None = None
    segment: bool = False
    data_location: int = 0
    external_data: list[tuple[str, str]] = field(default_factory=list)
    raw: tuple[int, int] | None = None
    typed: dict[int, list[tuple[int, int, int, int]]] = field(default_factory=dict)  # [(wire, field, value, end)]


class _Walker:
    """One walk over a ``ModelProto``'s framing: the tensors it holds (``found``), its own fields (``fields``,
    ``opsets``, ``props``), and the warnings of things left out."""

    def __init__(self, window: _Window) -> None:
        self.window = window
        self.path = window.path
        self.found: list[_Found] = []
        self.fields_set: dict[str, str] = {}
        self.opsets: list[tuple[str, int]] = []
        self.props: list[tuple[str, str]] = []
        self.warnings: list[str] = []

    def fields(self, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
        """(number, wire type, where the field starts, where its value starts, where it ends) of each field of the
        message at ``[start, end)``; a length-delimited value is its payload, which is not read here."""
        window = self.window
        position = start
        while position < end:
            tag, at = window.varint(position, end)
            number, wire = tag >> 3, tag & 7
            if wire == 0:
                stop = window.varint(at, end)[1]
            elif wire == 2:
                length, at = window.varint(at, end)
                stop = at + length
            elif wire == 1 or wire == 5:
                stop = at + (8 if wire == 1 else 4)
            else:
                raise InvalidProtobuf(
                    self.path,
                    f"field {number} at byte {position} has wire type {wire}, which onnx's messages never use",
                )
            if number == 0:
                raise InvalidProtobuf(self.path, f"the field at byte {position} has the number 0")
            if stop > end:
                whole = "the file" if end == self.window.size else "its message"
                raise TruncatedProtobuf(
                    self.path, f"field {number} at byte {position} runs to byte {stop}, past the end of {whole} ({end})"
                )
            yield number, wire, position, at, stop
            position = stop

    def text(self, start: int, end: int) -> str:
        """A string field as text; one that is not UTF-8 keeps its bytes as surrogate escapes (which ``metadata/``
        writes back as those bytes; a tensor name is refused)."""
        return self.window.get(start, end - start).decode("utf-8", "surrogateescape")

    def number(self, at: int, stop: int) -> int:
        return self.window.varint(at, stop)[0]

    def numbers(self, wire: int, at: int, stop: int) -> list[int]:
        """The values of a repeated varint field: one (wire type 0), or a packed run (2) of any number."""
        if wire == 0:
            return [self.number(at, stop)]
        values = _varints(self.window.get(at, stop - at))
        if values is None:
            raise TruncatedProtobuf(self.path, f"the packed varints at byte {at} end inside a varint")
        return values

    def nested(self, depth: int) -> None:
        if depth > MAX_NESTING:
            raise InvalidProtobuf(self.path, f"messages nest more than {MAX_NESTING} deep, protobuf's limit")

    def pair(self, start: int, end: int, version: bool = False) -> tuple[str, str | int]:
        """A ``StringStringEntryProto`` (key, value: two strings), or with ``version`` an ``OperatorSetIdProto``
        (domain, version: a string and an int64)."""
        first = ""
        second: str | int = 0 if version else ""
        for number, wire, _, at, stop in self.fields(start, end):
            if number == ENTRY_KEY and wire == 2:
                first = self.text(at, stop)
            elif number == ENTRY_VALUE and wire == (0 if version else 2):
                second = _int64(self.number(at, stop)) if version else self.text(at, stop)
        return first, second

    def model(self) -> None:
        for number, wire, _, at, stop in self.fields(0, self.window.size):
            if number == MODEL_GRAPH and wire == 2:
                self.graph(at, stop, 2)
            elif number in (MODEL_IR_VERSION, MODEL_MODEL_VERSION) and wire == 0:
                name = "ir_version" if number == MODEL_IR_VERSION else "model_version"
                self.fields_set[name] = str(_int64(self.number(at, stop)))
            elif number in MODEL_STRINGS and wire == 2:
                self.fields_set[MODEL_STRINGS[number]] = self.text(at, stop)
            elif number == MODEL_OPSET_IMPORT and wire == 2:
                domain, version = self.pair(at, stop, version=True)
                self.opsets.append((domain, int(version)))
            elif number == MODEL_METADATA_PROPS and wire == 2:
                key, value = self.pair(at, stop)
                self.props.append((key, str(value)))

    def graph(self, start: int, end: int, depth: int) -> None:
        self.nested(depth)
        for number, wire, _, at, stop in self.fields(start, end):
            if wire != 2:
                continue
            if number == GRAPH_INITIALIZER:
                self.tensor(at, stop, depth + 1, None)
            elif number == GRAPH_NODE:
                self.node(at, stop, depth + 1)
            elif number == GRAPH_SPARSE_INITIALIZER:
                self.sparse(at, stop, depth + 1, "a sparse initializer")

    def node(self, start: int, end: int, depth: int) -> None:
        self.nested(depth)
        output: str | None = None
        op_type = domain = ""
        attributes = []
        for number, wire, _, at, stop in self.fields(start, end):
            if wire != 2:
                continue
            if number == NODE_OUTPUT and output is None:
                output = self.text(at, stop)
            elif number == NODE_OP_TYPE:
                op_type = self.text(at, stop)
            elif number == NODE_DOMAIN:
                domain = self.text(at, stop)
            elif number == NODE_ATTRIBUTE:
                attributes.append((at, stop))
        constant = op_type == "Constant" and domain in ("", "ai.onnx")
        for at, stop in attributes:
            self.attribute(at, stop, depth + 1, (output or "") if constant else None)

    def attribute(self, start: int, end: int, depth: int, constant: str | None) -> None:
        """An attribute: the subgraphs it holds (any node's: If's branches, Loop's and Scan's bodies), and a
        ``Constant``'s ``value`` tensor, named by the node's output."""
        self.nested(depth)
        name = ""
        tensor = sparse = None
        graphs = []
        for number, wire, _, at, stop in self.fields(start, end):
            if wire != 2:
                continue
            if number == ATTRIBUTE_NAME:
                name = self.text(at, stop)
            elif number == ATTRIBUTE_T:
                tensor = (at, stop)
            elif number == ATTRIBUTE_SPARSE_TENSOR:
                sparse = (at, stop)
            elif number in (ATTRIBUTE_G, ATTRIBUTE_GRAPHS):
                graphs.append((at, stop))
        for at, stop in graphs:
            self.graph(at, stop, depth + 1)
        if constant is not None and name == "value" and tensor is not None:
            self.tensor(*tensor, depth + 1, constant)
        elif constant is not None and name == "sparse_value" and sparse is not None:
            self.sparse(*sparse, depth + 1, f"the sparse value of the Constant {constant!r}")

    def sparse(self, start: int, end: int, depth: int, what: str) -> None:
        """A sparse tensor (values at indices) is no array of bytes in C order: left out, named by its values'."""
        self.nested(depth)
        name = ""
        for number, wire, _, at, stop in self.fields(start, end):
            if number == SPARSE_VALUES and wire == 2:
                name = self.tensor(at, stop, depth + 1, None, keep=False).name
        self.warnings.append(f"{self.path}: tensor {name!r} is left out: it is {what}, which stfs does not serve")

    def tensor(self, start: int, end: int, depth: int, output: str | None, keep: bool = True) -> _Found:
        self.nested(depth)
        found = _Found(start, output)
        for number, wire, place, at, stop in self.fields(start, end):
            if number == TENSOR_RAW_DATA and wire == 2:
                found.raw = (at, stop)
            elif number in TYPED:
                if wire == 2 or wire == TYPED[number][1]:
                    found.typed.setdefault(number, []).append((wire, place, at, stop))
            elif number == TENSOR_DIMS and wire in (0, 2):
                found.dims.extend(_int64(value) for value in self.numbers(wire, at, stop))
            elif number == TENSOR_DATA_TYPE and wire == 0:
                found.data_type = _int32(self.number(at, stop))
            elif number == TENSOR_NAME and wire == 2:
                found.name = self.text(at, stop)
            elif number == TENSOR_DATA_LOCATION and wire == 0:
                location = _int32(self.number(at, stop))
                found.data_location = location if location in DATA_LOCATIONS else found.data_location
            elif number == TENSOR_EXTERNAL_DATA and wire == 2:
                key, value = self.pair(at, stop)
                found.external_data.append((key, str(value)))
            elif number == TENSOR_SEGMENT and wire == 2:
                for _ in self.fields(at, stop):  # its framing checked, as protobuf parses it; its begin, end unused
                    pass
                found.segment = True
        if keep:
            self.found.append(found)
        return found


@dataclass(frozen=True, slots=True)
class Held:
    """A tensor kept in typed fields (``int32_data``, ...): its bytes, made at mount as ``numpy_helper.to_array``
    gives them (F4 and F6 packed as safetensors packs them), held in memory; ``offset``: where its values start in
    the model's file (the ``offset`` xattr)."""

    offset: int
    data: bytes

    @property
    def span(self) -> tuple[int, int]:
        return self.offset, 0  # nothing of the file is read

    def read_into(self, read: Read, begin: int, view: memoryview) -> None:
        view[:] = self.data[begin : begin + len(view)]

    def layout(self, limit: int) -> tuple[Rows | bytes, ...] | str:
        return (self.data,)


@dataclass(frozen=True, slots=True)
class OnnxEntry(TensorEntry):
    """A tensor of an ONNX model: ``begin``/``end`` absolute in its file (its ``Header`` has ``data_start`` 0): the
    model's, or its external data's ``location``; or its bytes ``held``. Its files' xattrs ``user.onnx.*`` add
    ``data_type`` (ONNX's name: ``FLOAT``) and, for external data, ``location`` as written."""

    data_type: str = ""
    location: str | None = None
    held: Held | None = None

    @property
    def file(self) -> str | None:
        return posixpath.normpath(self.location) if self.location is not None else None

    @property
    def scattered(self) -> Held | None:
        return self.held

    @property
    def xattrs(self) -> dict[str, str]:
        found = {"data_type": self.data_type}
        if self.location is not None:
            found["location"] = self.location
        return found


class _Tensors:
    """The walk's tensors made ``OnnxEntry``s, in the order the file holds them, by onnx's rules."""

    def __init__(self, window: _Window) -> None:
        self.window = window
        self.path = window.path
        self.held = 0
        self.names: set[str] = set()
        self.files: dict[str, None] = {}  # every external data file, in the order first named
        self.entries: list[OnnxEntry] = []
        self.warnings: list[str] = []

    def add(self, found: _Found) -> None:
        name = found.output or found.name
        if not encodable(name):
            raise InvalidProtobuf(self.path, f"tensor name {name!r} is not UTF-8, as protobuf's strings are")
        data_type = found.data_type
        if data_type is None or not 0 < data_type < len(DATA_TYPES):
            shown = "missing" if data_type is None else f"{data_type}" + (" (UNDEFINED)" if data_type == 0 else "")
            raise UnknownDataType(self.path, f"data_type {shown} is not one of onnx's", name)
        type_name = DATA_TYPES[data_type]
        dims = found.dims
        if any(dim < 0 for dim in dims):
            raise InvalidDims(self.path, f"dims {dims} hold a negative number", name)
        count = math.prod(dims)
        if count > U64_MAX:
            raise InvalidDims(self.path, f"dims {dims} hold more than 2^64 values", name)
        external = None
        if found.data_location == EXTERNAL:
            external = self.external(found, name)  # every location is checked: files/ shows every data file
            self.files.setdefault(posixpath.normpath(external[0]))
        dtype = DTYPES.get(data_type)
        if dtype is None:
            return self.leave_out(name, f"its data_type {type_name} has no safetensors dtype")
        if count * DTYPE_BITS[dtype] % 8:
            return self.leave_out(name, f"{count} values of {type_name} are not whole bytes, as a safetensors dtype's")
        if found.segment:
            return self.leave_out(name, "it is a segment of a tensor, which onnx's numpy_helper does not read either")
        if name in self.names:
            return self.leave_out(name, "an earlier tensor of the model has its name")
        self.names.add(name)
        size = count * DTYPE_BITS[dtype] // 8
        need = f"dims {dims} of {type_name} need {size} bytes"
        common = (name, dtype, tuple(dims))
        if external is not None:
            location, offset, length = external
            if length is not None and length != size:
                raise TensorLengthMismatch(self.path, f"its external data's length is {length}; {need}", name)
            self.entries.append(OnnxEntry(*common, offset, offset + size, type_name, location))
        elif found.raw is not None:
            begin, end = found.raw
            if end - begin != size:
                raise TensorLengthMismatch(self.path, f"raw_data is {end - begin} bytes; {need}", name)
            self.entries.append(OnnxEntry(*common, begin, end, type_name))
        else:
            self.typed(found, common, count, size, type_name)
        return None

    def leave_out(self, name: str, why: str) -> None:
        self.warnings.append(f"{self.path}: tensor {name!r} is left out: {why}")

    def external(self, found: _Found, name: str) -> tuple[str, int, int | None]:
        """``location`` (relative to the model's folder and inside it), ``offset`` and ``length`` (or ``None``) of a
        tensor's external data; the last of a key written twice counts, as onnx's ``ExternalDataInfo`` reads them."""
        info = dict(found.external_data)
        location = info.get("location")
        if not location:
            raise InvalidExternalData(self.path, "its data_location is EXTERNAL but it has no location", name)
        parts = location.replace("\\", "/").split("/")
        if location.startswith(("/", "\\")) or (len(location) > 1 and location[1] == ":") or ".." in parts:
            raise LocationOutsideFolder(self.path, f"location {location!r} is outside the model's folder", name)
        if "\0" in location or posixpath.normpath(location) == ".":
            raise LocationOutsideFolder(self.path, f"location {location!r} names no file of its folder", name)
        numbers = []
        for key in ("offset", "length"):
            value = info.get(key)
            try:
                number = None if value is None else int(value)
            except ValueError:
                number = -1
            if number is not None and number < 0:
                raise InvalidExternalData(self.path, f"{key} {value!r} is not a non-negative integer", name)
            numbers.append(number)
        return location, numbers[0] or 0, numbers[1]

    def typed(
        self, found: _Found, common: tuple[str, str, tuple[int, ...]], count: int, size: int, type_name: str
    ) -> None:
        """A tensor in its type's typed field (the one ``helper.tensor_dtype_to_field`` names, which ``to_array``
        reads): one packed run of ``float_data`` or ``double_data`` is a range of the file; the values of other
        fields, in all their runs (packed or not), are made into the bytes of ``to_array``'s array and held."""
        name, dtype = common[0], common[1]
        data_type = found.data_type or 0
        number = TYPED_FIELD.get(data_type, 5)
        field_name, wire = TYPED[number]
        runs = found.typed.get(number, [])
        if data_type in (FLOAT, COMPLEX64, DOUBLE) and len(runs) == 1 and runs[0][0] == 2:
            _, _, begin, end = runs[0]  # packed fixed-width values: already their little-endian bytes
            if end - begin != size:
                width = 8 if data_type == DOUBLE else 4
                raise TensorLengthMismatch(
                    self.path,
                    f"{field_name} holds {(end - begin) // width} values; {_values(common[2], type_name)}",
                    name,
                )
            self.entries.append(OnnxEntry(*common, begin, end, type_name))
            return
        if not runs and not count:
            self.entries.append(OnnxEntry(*common, found.start, found.start, type_name))
            return
        stored = sum(end - start for _, start, _, end in runs)
        self.hold(self.held + stored, field_name, name)  # what decoding takes, before it is decoded
        pieces = []
        for run_wire, start, at, end in runs:
            piece = self.window.get(at, end - at)
            if run_wire == 2 and not _ends_whole(piece, wire):
                raise InvalidProtobuf(self.path, f"the packed {field_name} at byte {start} ends inside a value", name)
            pieces.append(piece)
        stream = b"".join(pieces)  # the values back to back, packed or not: one run of them
        held = len(stream) // FIXED[wire] if wire else _count_varints(stream)
        expected = {COMPLEX64: 2 * count, COMPLEX128: 2 * count}.get(data_type, count)
        if dtype == "F4":
            expected = (count + 1) // 2  # two values an int32, as raw_data packs them
        if held != expected:
            raise TensorLengthMismatch(
                self.path, f"{field_name} holds {held} values; {_values(common[2], type_name)}", name
            )
        self.held = self.hold(self.held + size, field_name, name)
        data = _typed_bytes(stream, wire, data_type, self.path, name)
        begin = runs[0][2]
        self.entries.append(OnnxEntry(*common, begin, begin + len(data), type_name, None, Held(begin, data)))

    def hold(self, total: int, field: str, name: str) -> int:
        """``total`` bytes of tensors from typed fields held in memory, if within ``HELD_LIMIT``."""
        if total > HELD_LIMIT:
            raise TypedDataTooLarge(
                self.path,
                f"its {field} and the typed fields before it take {total} bytes, more than the {HELD_LIMIT} stfs "
                "holds in memory for a model: save it with raw_data (numpy_helper.from_array) or external data",
                name,
            )
        return total


def _values(dims: tuple[int, ...], type_name: str) -> str:
    count = math.prod(dims)
    if type_name in ("COMPLEX64", "COMPLEX128"):
        return f"dims {list(dims)} of {type_name} need {2 * count} (a real and an imaginary part each)"
    if type_name == "FLOAT4E2M1":
        return f"dims {list(dims)} of {type_name} need {(count + 1) // 2} (two 4-bit values each)"
    return f"dims {list(dims)} of {type_name} need {count}"


# -- typed fields as to_array reads them ------------------------------------------------------------------------------


def _int32(value: int) -> int:
    """A varint as an int32 field holds it: its low 32 bits, signed (protobuf truncates a longer one)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >> 31 else value


def _int64(value: int) -> int:
    value &= U64_MAX
    return value - (1 << 64) if value >> 63 else value


_CONTINUED = bytes(range(0x80, 0x100))
FIXED = {5: 4, 1: 8}  # wire type -> bytes of a value
PACKS = {1: "B", 2: "H", 4: "I", 8: "Q"}  # bytes of an integer -> its struct code


def _ends_whole(run: bytes, wire: int) -> bool:
    """Whether a packed run of values of wire type ``wire`` ends where its last value does (else protobuf refuses
    the message)."""
    return (not run or run[-1] < 0x80) if wire == 0 else len(run) % FIXED[wire] == 0


def _count_varints(stream: bytes) -> int:
    """How many varints ``stream`` holds: its bytes without the continuation bit, each one's last."""
    return len(stream.translate(None, _CONTINUED))


def _varints(stream: bytes) -> list[int] | None:
    """The varints of ``stream``, each to 64 bits as protobuf keeps them; ``None`` if one runs past its end or over
    10 bytes."""
    values = []
    value = shift = 0
    for byte in stream:
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            values.append(value & U64_MAX)
            value = shift = 0
            continue
        shift += 7
        if shift >= 70:
            return None
    return None if shift else values


def _narrowed(stream: bytes, width: int, path: str, name: str) -> bytes:
    """The varints of ``stream`` as ``width``-byte little-endian integers, each its value's low bytes: what
    ``np.array(values, storage dtype).astype(dtype)`` and ``.view(uint32).astype(uint16)`` keep of them. Numpy
    decodes a long run (a chunk at a time), Python a short one."""
    if len(stream) > PYTHON_VARINTS:
        return _narrowed_numpy(stream, width, path, name)
    if stream.isascii() and width == 1:
        return stream  # every value under 128: a byte each
    values = _varints(stream)
    if values is None:
        raise InvalidProtobuf(path, "a varint of its typed field is longer than 10 bytes", name)
    mask = (1 << 8 * width) - 1
    return struct.pack(f"<{len(values)}{PACKS[width]}", *(value & mask for value in values))


def _narrowed_numpy(stream: bytes, width: int, path: str, name: str) -> bytes:
    import numpy as np

    data = np.frombuffer(stream, np.uint8)
    out = []
    position = 0
    while position < len(data):
        chunk = data[position : position + NUMPY_CHUNK]
        ends = np.flatnonzero(chunk < 0x80)
        if not len(ends):
            raise InvalidProtobuf(path, "a varint of its typed field is longer than 10 bytes", name)
        chunk = chunk[: ends[-1] + 1]
        starts = np.concatenate(([0], ends[:-1] + 1))
        lengths = ends - starts + 1
        if lengths.max() > 10:
            raise InvalidProtobuf(path, "a varint of its typed field is longer than 10 bytes", name)
        place = np.arange(len(chunk)) - np.repeat(starts, lengths)  # each byte's place in its varint
        parts = (chunk & 0x7F).astype(np.uint64) << (7 * place).astype(np.uint64)  # bits past 64 shifted out
        values = np.add.reduceat(parts, starts)  # no two parts share a bit: the sum is their or
        out.append(values.astype(f"<u{width}").tobytes())  # wraps: the low bytes
        position += len(chunk)
    return b"".join(out)


def _typed_bytes(stream: bytes, wire: int, data_type: int, path: str, name: str) -> bytes:
    """The bytes of ``numpy_helper.to_array``'s array of a tensor whose typed field holds the values ``stream``
    (their encodings back to back), F4 and F6 packed as safetensors packs them. ``float_data`` and ``double_data``
    (FLOAT, COMPLEX64 as real and imaginary pairs, DOUBLE) are already those bytes; of ``int32_data``,
    ``int64_data`` and ``uint64_data`` each value keeps its low bytes, as many as its type has (to_array's casts
    wrap, and ``.view(uint32).astype(uint16)`` does the same); FLOAT4E2M1 keeps a byte per two values, as raw_data
    packs them (``_unpack_4bit`` then safetensors' packing give that byte back); FLOAT6 keeps six bits a value."""
    if wire:
        return stream
    data = _narrowed(stream, NARROWED.get(data_type, 1), path, name)
    if data_type in F6:
        return _pack_f6(data)
    return data


def _pack_f6(codes: bytes) -> bytes:
    """Six-bit codes (the low six bits of each byte) four in three bytes, element k at bit 6k of the little-endian
    bit stream, as safetensors' F6 (and raw_data) hold them; a whole number of groups of four."""
    if len(codes) > PYTHON_VARINTS:
        import numpy as np

        c = [np.frombuffer(codes, np.uint8)[k::4] & 0x3F for k in range(4)]
        groups = np.stack([c[0] | (c[1] << 6), (c[1] >> 2) | (c[2] << 4), (c[2] >> 4) | (c[3] << 2)], axis=1)
        return bytes(groups.astype(np.uint8).tobytes())
    out = bytearray()
    for k in range(0, len(codes), 4):
        c0, c1, c2, c3 = (code & 0x3F for code in codes[k : k + 4])
        out += bytes(((c0 | c1 << 6) & 0xFF, (c1 >> 2 | c2 << 4) & 0xFF, (c2 >> 4 | c3 << 2) & 0xFF))
    return bytes(out)


def _metadata(walker: _Walker, warnings: list[str]) -> dict[str, str]:
    """``metadata/``: the model's own fields where set (``ir_version``, ``producer_name``, ``producer_version``,
    ``domain``, ``model_version``, ``doc_string``), ``opset.DOMAIN`` per opset (``opset.ai.onnx`` for the default
    domain), then each of ``metadata_props`` (a key the fields took is warned of and left out)."""
    found = {name: walker.fields_set[name] for name in MODEL_FIELDS if name in walker.fields_set}
    for domain, version in walker.opsets:
        found[f"opset.{domain or 'ai.onnx'}"] = str(version)
    for key, value in walker.props:
        if key in found:
            warnings.append(f"{walker.path}: metadata_props key {key!r} is left out: the model's {key} took it")
            continue
        found[key] = value
    return found


def fetch_header(fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0) -> Header:
    """Read and validate the ONNX model ``path`` through ``fetch`` as a ``Header``: its tensors (``data_start`` 0,
    each ``begin``/``end`` absolute in its file), ``metadata/`` and ``header.json`` made in the safetensors schema,
    and a warning for each tensor left out."""
    window = _Window(fetch, file_size, path, first_read)
    walker = _Walker(window)
    walker.model()
    tensors = _Tensors(window)
    for found in walker.found:
        tensors.add(found)
    warnings = walker.warnings + tensors.warnings
    metadata = _metadata(walker, warnings)
    entries = tensors.entries
    return made_header(
        path=path,
        file_size=file_size,
        mtime_ns=mtime_ns,
        tensors=entries,
        metadata=metadata,
        warnings=tuple(warnings),
        other_files=tuple(tensors.files),
    )


# The first bytes of a ModelProto as onnx writes it: ir_version (field 1, a varint), then another of its fields.
_MODEL_TAGS = frozenset((0x12, 0x1A, 0x22, 0x28, 0x32, 0x3A, 0x42, 0x72))


class _Onnx(Format):
    name = "onnx"
    title = "ONNX"
    head_size = 16

    def sniff(self, head: bytes) -> bool:
        """``ir_version`` (a small varint) first, then another field of a ``ModelProto``."""
        return len(head) >= 3 and head[0] == 0x08 and 0 < head[1] < 0x80 and head[2] in _MODEL_TAGS

    def read_header(
        self, fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0
    ) -> Header:
        return fetch_header(fetch, path=path, file_size=file_size, mtime_ns=mtime_ns, first_read=first_read)

    def safetensors_name(self, path: str) -> str | None:
        """``x.onnx`` -> ``x.safetensors``."""
        return path[: -len(".onnx")] + ".safetensors" if path.endswith(".onnx") else path + ".safetensors"


FORMAT: Format = _Onnx()
