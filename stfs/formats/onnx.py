"""ONNX models (SPEC §13): every initializer of the graph, of its subgraphs (the bodies of If, Loop, Scan) and every
``Constant`` node's tensor, each a tensor of its bytes in C order as onnx's ``numpy_helper.to_array`` gives them.

The file is one protobuf ``ModelProto``; a model with its weights inside holds them as ``raw_data`` fields of up to
2 GiB. So the messages are never read whole: this module follows protobuf's framing alone (a tag, a varint length)
to find each ``TensorProto`` and where its ``raw_data`` lies, reading a window at a time through the range fetcher
and passing over the payloads unread, and the ``onnx`` package decodes the rest of each message (a tensor's fields
less its data, the model's fields less its graph). A tensor's bytes are then one range of the model's file
(``raw_data``, or a ``float_data``/``double_data`` packed as one run, which is already the values' little-endian
bytes), one range of another file of its folder (external data, ``TensorEntry.file``), or, kept in other typed
fields (``int32_data`` for float16, ...), made at mount as ``numpy_helper.to_array`` makes them and held in memory
(``Held``; a bounded total of them).

Refused in one line naming the file, the tensor and the rule (``OnnxError``): a truncated or malformed
protobuf, an unknown ``data_type``, negative ``dims``, bytes that are not ``dims`` times the type's size, external
data without a ``location`` or outside the model's folder; ``model`` then checks each external data file is there
and holds its tensors. A tensor of a type safetensors lacks (string, complex128, 2- and 4-bit integers) is left out
with a warning naming it, as is a tensor whose name an earlier one took.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .. import errors
from .base import Format, Header, RangeFetcher, Read, TensorEntry, encodable, header_json
from .dtypes import DTYPE_BITS

# -- the rules, one error each (SPEC §13, docs/onnx.md) ----------------------------------------------------------------


class OnnxError(errors.RuleError):
    """An ONNX model is refused (SPEC §13): its protobuf is broken, or a tensor breaks a rule of onnx's reader.

    ``rule_text`` names the rule in a few words; the message names the file, the tensor where there is one, and why.
    """

    rule_text = "invalid ONNX model"
    format_name = "ONNX"


class OnnxUnavailable(OnnxError):
    """The ``onnx`` package, which decodes an ONNX model's messages, is not installed."""

    rule_text = "needs the onnx package"
    refutes_format = True  # a folder's .onnx file is then left in files/, not a model


class TruncatedProtobuf(OnnxError):
    """A field's length or a varint runs past the end of the message holding it, or of the file."""

    rule_text = "protobuf inside the file"


class InvalidProtobuf(OnnxError):
    """The bytes are not protobuf as onnx's messages are: a wire type or field number protobuf has not, a varint
    over 10 bytes, messages nested past protobuf's limit, a message the onnx package refuses to decode."""

    rule_text = "protobuf"


class UnknownDataType(OnnxError):
    """A tensor's ``data_type`` is not one of ``TensorProto.DataType`` (or is ``UNDEFINED``)."""

    rule_text = "known data_type"


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


class LocationOutsideFolder(OnnxError):
    """An external data ``location`` is absolute, empty, or climbs out of the model's folder with ``..``."""

    rule_text = "external data inside the model's folder"


class TypedDataTooLarge(OnnxError):
    """The tensors a model keeps in typed fields (``int32_data``, ...) would need more than stfs holds in memory."""

    rule_text = "typed fields within bounds"


# Bytes read at once while walking the framing: a window after a jump over a payload, doubled while the walk reads
# on from where the last ended (the nodes of a large graph), up to the most. A payload past a window is not read.
WINDOW = 4 << 10
MAX_WINDOW = 1 << 20
MAX_NESTING = 100  # messages nested in each other: protobuf's default recursion limit, which onnx's parser keeps
HELD_LIMIT = 64 << 20  # bytes of tensors kept in typed fields that one model may hold in memory
U64_MAX = 2**64 - 1

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
FLOAT, COMPLEX64, DOUBLE, COMPLEX128 = 1, 14, 11, 15
EXTERNAL = 1  # TensorProto.DataLocation

# Fields of the messages, by number (onnx.proto3).
MODEL_GRAPH = 7
MODEL_KEPT = frozenset((1, 2, 3, 4, 5, 6, 8, 14))  # ir_version ... doc_string, opset_import, metadata_props
GRAPH_NODE, GRAPH_INITIALIZER, GRAPH_SPARSE_INITIALIZER = 1, 5, 15
NODE_OUTPUT, NODE_OP_TYPE, NODE_ATTRIBUTE, NODE_DOMAIN = 2, 4, 5, 7
ATTRIBUTE_NAME, ATTRIBUTE_T, ATTRIBUTE_G, ATTRIBUTE_GRAPHS, ATTRIBUTE_SPARSE_TENSOR = 1, 5, 6, 11, 22
SPARSE_VALUES = 1
TENSOR_KEPT = frozenset((1, 2, 3, 8, 13, 14))  # dims, data_type, segment, name, external_data, data_location
TENSOR_DATA_TYPE, TENSOR_RAW_DATA = 2, 9
TENSOR_TYPED = frozenset((4, 5, 7, 10, 11))  # float_data, int32_data, int64_data, double_data, uint64_data


def _onnx(path: str) -> Any:
    """The ``onnx`` package, imported when a model is read (stfs reads every other format without it)."""
    try:
        import onnx
        import onnx.numpy_helper  # noqa: F401 (to_array, used through the package)
    except ImportError as exc:
        raise OnnxUnavailable(
            path, f"reading ONNX models needs the onnx package: pip install onnx (or stfs[onnx]) ({exc})"
        ) from None
    return onnx


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


@dataclass(frozen=True, slots=True)
class _Found:
    """A ``TensorProto`` as the walk found it: its fields less its data (for the onnx package to decode), where its
    ``raw_data`` is, where each typed field's values are, the ``data_type`` as written, and the name of the
    ``Constant`` whose value it is."""

    start: int
    kept: bytes
    raw: tuple[int, int] | None
    typed: dict[int, list[tuple[int, int, int, int]]]  # field -> [(wire type, field start, value start, end)]
    data_type: int | None
    output: str | None


class _Walker:
    """One walk over a ``ModelProto``'s framing: the tensors it holds (``found``), its fields less its graph
    (``kept``), and the warnings of things left out."""

    def __init__(self, window: _Window) -> None:
        self.window = window
        self.path = window.path
        self.found: list[_Found] = []
        self.kept: list[bytes] = []
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
        return self.window.get(start, end - start).decode("utf-8", "surrogateescape")

    def nested(self, depth: int) -> None:
        if depth > MAX_NESTING:
            raise InvalidProtobuf(self.path, f"messages nest more than {MAX_NESTING} deep, protobuf's limit")

    def model(self) -> None:
        for number, wire, field, at, stop in self.fields(0, self.window.size):
            if number == MODEL_GRAPH and wire == 2:
                self.graph(at, stop, 2)
            elif number in MODEL_KEPT:
                self.kept.append(self.window.get(field, stop - field))

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
                found = self.tensor(at, stop, depth + 1, None, keep=False)
                name = _onnx(self.path).TensorProto.FromString(found.kept).name
        self.warnings.append(f"{self.path}: tensor {name!r} is left out: it is {what}, which stfs does not serve")

    def tensor(self, start: int, end: int, depth: int, output: str | None, keep: bool = True) -> _Found:
        self.nested(depth)
        kept = []
        raw = None
        typed: dict[int, list[tuple[int, int, int, int]]] = {}
        data_type = None
        for number, wire, field, at, stop in self.fields(start, end):
            if number in TENSOR_KEPT:
                kept.append(self.window.get(field, stop - field))
                if number == TENSOR_DATA_TYPE:
                    data_type = self.window.varint(at, stop)[0] if wire == 0 else None
            elif number == TENSOR_RAW_DATA and wire == 2:
                raw = (at, stop)  # protobuf keeps the last of a field written twice
            elif number in TENSOR_TYPED:
                typed.setdefault(number, []).append((wire, field, at, stop))
        found = _Found(start, b"".join(kept), raw, typed, data_type, output)
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

    def __init__(self, window: _Window, onnx: Any) -> None:
        self.window = window
        self.path = window.path
        self.onnx = onnx
        self.held = 0
        self.names: set[str] = set()
        self.files: dict[str, None] = {}  # every external data file, in the order first named
        self.entries: list[OnnxEntry] = []
        self.warnings: list[str] = []

    def decode(self, kept: bytes, what: str) -> Any:
        try:
            return self.onnx.TensorProto.FromString(kept)
        except Exception as exc:  # google.protobuf's DecodeError, or a RecursionError
            raise InvalidProtobuf(self.path, f"the onnx package cannot decode {what}: {exc}") from None

    def add(self, found: _Found) -> None:
        proto = self.decode(found.kept, f"the tensor at byte {found.start}")
        name = found.output or _string(proto.name)
        if not encodable(name):
            raise InvalidProtobuf(self.path, f"tensor name {name!r} is not UTF-8, as protobuf's strings are")
        data_type = found.data_type
        names = self.onnx.TensorProto.DataType
        if data_type is None or data_type == 0 or data_type not in names.values():
            shown = "missing" if data_type is None else f"{data_type}" + (" (UNDEFINED)" if data_type == 0 else "")
            raise UnknownDataType(self.path, f"data_type {shown} is not one of onnx's", name)
        type_name = names.Name(data_type)
        dims = list(proto.dims)
        if any(dim < 0 for dim in dims):
            raise InvalidDims(self.path, f"dims {dims} hold a negative number", name)
        count = math.prod(dims)
        if count > U64_MAX:
            raise InvalidDims(self.path, f"dims {dims} hold more than 2^64 values", name)
        external = None
        if proto.HasField("data_location") and proto.data_location == EXTERNAL:
            external = self.external(proto, name)  # every location is checked: files/ shows every data file
            self.files.setdefault(posixpath.normpath(external[0]))
        dtype = DTYPES.get(data_type)
        if dtype is None:
            return self.leave_out(name, f"its data_type {type_name} has no safetensors dtype")
        if count * DTYPE_BITS[dtype] % 8:
            return self.leave_out(name, f"{count} values of {type_name} are not whole bytes, as a safetensors dtype's")
        if proto.HasField("segment"):
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
            self.typed(found, proto, common, count, size, type_name)
        return None

    def leave_out(self, name: str, why: str) -> None:
        self.warnings.append(f"{self.path}: tensor {name!r} is left out: {why}")

    def external(self, proto: Any, name: str) -> tuple[str, int, int | None]:
        """``location`` (relative to the model's folder and inside it), ``offset`` and ``length`` (or ``None``) of a
        tensor's external data; the last of a key written twice counts, as onnx's ``ExternalDataInfo`` reads them."""
        info = {_string(entry.key): _string(entry.value) for entry in proto.external_data}
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
        self, found: _Found, proto: Any, common: tuple[str, str, tuple[int, ...]], count: int, size: int, type_name: str
    ) -> None:
        """A tensor in its type's typed field (which ``helper.tensor_dtype_to_field`` names, as ``to_array`` reads
        it): one packed run of ``float_data`` or ``double_data`` is a range of the file; other fields are made into
        bytes by ``numpy_helper.to_array`` and held."""
        name, dtype = common[0], common[1]
        field = self.onnx.helper.tensor_dtype_to_field(self.onnx.TensorProto.DataType.Value(type_name))
        number = self.onnx.TensorProto.DESCRIPTOR.fields_by_name[field].number
        runs = found.typed.get(number, [])
        data_type = found.data_type
        if data_type in (FLOAT, COMPLEX64, DOUBLE) and len(runs) == 1 and runs[0][0] == 2:
            _, _, begin, end = runs[0]  # packed fixed-width values: already their little-endian bytes
            if end - begin != size:
                width = 8 if data_type == DOUBLE else 4
                raise TensorLengthMismatch(
                    self.path, f"{field} holds {(end - begin) // width} values; {_values(common[2], type_name)}", name
                )
            self.entries.append(OnnxEntry(*common, begin, end, type_name))
            return
        if not runs and not count:
            self.entries.append(OnnxEntry(*common, found.start, found.start, type_name))
            return
        stored = sum(end - start for _, start, _, end in runs)
        self.hold(self.held + stored, field, name)  # what decoding takes, before it is decoded
        values = b"".join(self.window.get(start, end - start) for _, start, _, end in runs)
        whole = self.decode(found.kept + values, f"tensor {name!r}'s {field}")
        held = len(getattr(whole, field))
        expected = {COMPLEX64: 2 * count, COMPLEX128: 2 * count}.get(data_type or 0, count)
        if dtype == "F4":
            expected = (count + 1) // 2  # two values an int32, as raw_data packs them
        if held != expected:
            raise TensorLengthMismatch(self.path, f"{field} holds {held} values; {_values(common[2], type_name)}", name)
        self.held = self.hold(self.held + size, field, name)
        data = _packed(self.onnx.numpy_helper.to_array(whole), dtype)
        self.entries.append(
            OnnxEntry(*common, runs[0][2], runs[0][2] + len(data), type_name, None, Held(runs[0][2], data))
        )

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


def _packed(array: Any, dtype: str) -> bytes:
    """The bytes of ``to_array``'s array as safetensors holds the dtype: F4 two values a byte and F6 four in three
    bytes, element k at bit 4k or 6k of the little-endian bit stream (``to_array`` gives a byte a value)."""
    import numpy as np

    codes = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    if dtype == "F4":
        return bytes(((codes[0::2] & 0x0F) | (codes[1::2] << 4)).astype(np.uint8).tobytes())
    if dtype in ("F6_E2M3", "F6_E3M2"):
        c = [codes[k::4].astype(np.uint8) & 0x3F for k in range(4)]
        groups = np.stack([c[0] | (c[1] << 6), (c[1] >> 2) | (c[2] << 4), (c[2] >> 4) | (c[3] << 2)], axis=1)
        return bytes(groups.astype(np.uint8).tobytes())
    return bytes(np.ascontiguousarray(array).tobytes())


def _metadata(proto: Any, path: str, warnings: list[str]) -> dict[str, str]:
    """``metadata/``: the model's own fields where set (``ir_version``, ``producer_name``, ``producer_version``,
    ``domain``, ``model_version``, ``doc_string``), ``opset.DOMAIN`` per opset (``opset.ai.onnx`` for the default
    domain), then each of ``metadata_props`` (a key the fields took is warned of and left out)."""
    found: dict[str, str] = {}
    for field in ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string"):
        if proto.HasField(field):
            found[field] = _string(getattr(proto, field))
    for opset in proto.opset_import:
        found[f"opset.{_string(opset.domain) or 'ai.onnx'}"] = str(opset.version)
    for prop in proto.metadata_props:
        key = _string(prop.key)
        if key in found:
            warnings.append(f"{path}: metadata_props key {key!r} is left out: the model's {key} took it")
            continue
        found[key] = _string(prop.value)
    return found


def _string(value: str | bytes | int) -> str:
    """A protobuf string field as text: the onnx package gives bytes for one that is not UTF-8 (kept as surrogate
    escapes, which ``metadata/`` writes back as those bytes)."""
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


def fetch_header(fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0) -> Header:
    """Read and validate the ONNX model ``path`` through ``fetch`` as a ``Header``: its tensors (``data_start`` 0,
    each ``begin``/``end`` absolute in its file), ``metadata/`` and ``header.json`` made in the safetensors schema,
    and a warning for each tensor left out."""
    onnx = _onnx(path)
    window = _Window(fetch, file_size, path, first_read)
    walker = _Walker(window)
    walker.model()
    tensors = _Tensors(window, onnx)
    for found in walker.found:
        tensors.add(found)
    try:
        model = onnx.ModelProto.FromString(b"".join(walker.kept))
    except Exception as exc:  # google.protobuf's DecodeError
        raise InvalidProtobuf(path, f"the onnx package cannot decode the model's fields: {exc}") from None
    warnings = walker.warnings + tensors.warnings
    metadata = _metadata(model, path, warnings)
    entries = tensors.entries
    made = header_json(entries, metadata)
    return Header(
        path=path,
        file_size=file_size,
        mtime_ns=mtime_ns,
        tensors=tuple(entries),
        metadata=metadata,
        digest=hashlib.sha256(made).digest(),
        data_start=0,
        json_made=made,
        warnings=tuple(warnings),
        other_files=tuple(tensors.files),
    )


# The first bytes of a ModelProto as onnx writes it: ir_version (field 1, a varint), then another of its fields.
_MODEL_TAGS = frozenset((0x12, 0x1A, 0x22, 0x28, 0x32, 0x3A, 0x42, 0x72))


def _installed() -> bool:
    return importlib.util.find_spec("onnx") is not None


class _Onnx(Format):
    name = "onnx"
    title = "ONNX"
    head_size = 16

    def __init__(self) -> None:
        # Without the onnx package a folder's .onnx files are looked at before they are taken as models, and left in
        # files/ (read_header's OnnxUnavailable refutes them) instead of refusing the folder; one named gets the line.
        self.confirm_in_folder = not _installed()

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
