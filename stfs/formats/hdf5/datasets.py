"""A dataset as a tensor: its dtype (safetensors' name for its datatype, Keras' bfloat16 included), shape, and
where its bytes are (compact and contiguous: one range; chunked: ``Chunked``); or a refusal in one line saying what
the dataset is, that stfs cannot serve it, and what to do instead."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..base import TensorEntry
from .attributes import text_value
from .heaps import GlobalHeap
from .io import Fields, Reader
from .messages import (
    DATASPACE,
    DATATYPE,
    ENUM,
    EXTERNAL,
    FIXED,
    FLOAT,
    LAYOUT,
    OPAQUE,
    PIPELINE,
    SHARED,
    Datatype,
    read_dataspace,
    read_datatype,
    read_filters,
    read_layout,
)
from .objects import Message, read_object
from .rules import BadStructure, FilteredDataset, Hdf5Truncated, UnsupportedStorage, UnsupportedType
from .walk import attributes

if TYPE_CHECKING:
    from .chunks import Chunked

FLOATS = {(2, 5, 10): "F16", (2, 8, 7): "BF16", (4, 8, 23): "F32", (8, 11, 52): "F64"}
SIGNED = {1: "I8", 2: "I16", 4: "I32", 8: "I64"}
UNSIGNED = {1: "U8", 2: "U16", 4: "U32", 8: "U64"}
_KIND = operator.itemgetter(0)  # a Message's kind
NAMED = -1  # the memo's kind of a datatype message named as a dtype


@dataclass(frozen=True, slots=True)
class Hdf5Entry(TensorEntry):
    """A dataset's tensor: ``begin``/``end`` absolute in the file (its ``Header`` has ``data_start`` 0); a chunked one
    gathered by ``chunked`` (``begin`` where its lowest chunk lies). Its files' xattrs ``user.hdf5.*`` add ``dataset``,
    its path in the file."""

    dataset: str = ""
    chunked: Chunked | None = None

    @property
    def scattered(self) -> Chunked | None:
        return self.chunked

    @property
    def xattrs(self) -> Mapping[str, str]:
        return {"dataset": self.dataset}


def tensor_name(path: tuple[str, ...]) -> str:
    """A dataset's tensor name: its path of link names joined by ``.``, a ``.`` or ``%`` in a name escaped (``%2E``,
    ``%25``) so that the name says the path."""
    name = ".".join(path)
    if "%" not in name and name.count(".") == len(path) - 1:  # no part to escape (most names)
        return name
    return ".".join(part.replace("%", "%25").replace(".", "%2E") for part in path)


def _one(messages: list[Message], kind: int) -> Message | None:
    return next((message for message in messages if message.kind == kind), None)


def _datatype(reader: Reader, message: Message, name: str) -> Datatype:
    if not message.flags & SHARED:  # most datasets of a file share a few datatypes: each decoded once
        found = reader.memo.get((DATATYPE, message.data))
        if found is None:
            found = reader.memo[DATATYPE, message.data] = read_datatype(
                Fields(reader, message.data, "a datatype message")
            )
        return found
    fields = Fields(reader, message.data, "a shared datatype")
    version, kind = fields.u8(), fields.u8()
    if version == 1:
        fields.skip(6)
    if version not in (1, 2, 3) or (version == 3 and kind != 2):
        raise UnsupportedStorage(reader.path, "its datatype is kept in the shared message heap", name)
    committed = read_object(reader, fields.address())
    found = _one(committed, DATATYPE)
    if found is None or found.flags & SHARED:
        raise BadStructure(reader.path, "its committed datatype holds no datatype message", name)
    return read_datatype(Fields(reader, found.data, "a datatype message"))


def dtype_name(reader: Reader, heap: GlobalHeap, datatype: Datatype, messages: list[Message], name: str) -> str:
    """Safetensors' dtype for a dataset's datatype; a refusal for one a tensor cannot hold."""
    keras = None
    if datatype.cls in (OPAQUE, FIXED) and datatype.size == 2:
        for attribute in attributes(reader, messages):
            if attribute.name == "dtype":
                keras = text_value(reader, heap, attribute)
    if keras == "bfloat16" and not datatype.big and (datatype.cls == OPAQUE or not datatype.signed):
        return "BF16"  # Keras 3 writes bfloat16 as 2-byte opaque values with a dtype attribute naming them
    if datatype.cls in (FIXED, FLOAT) and datatype.big:
        raise UnsupportedType(
            reader.path,
            f"it holds big-endian {datatype.title} values; stfs serves little-endian bytes only: "
            "write it as little-endian ('<' dtypes in h5py)",
            name,
        )
    if datatype.cls == FIXED:
        table = SIGNED if datatype.signed else UNSIGNED
        if datatype.size in table and datatype.bit_offset == 0 and datatype.precision == 8 * datatype.size:
            return table[datatype.size]
    elif datatype.cls == FLOAT:
        key = (datatype.size, datatype.exponent, datatype.mantissa)
        if key in FLOATS and datatype.bit_offset == 0 and datatype.precision == 8 * datatype.size:
            return FLOATS[key]
    elif datatype.cls == ENUM and datatype.size == 1 and sorted(datatype.members) == [("FALSE", 0), ("TRUE", 1)]:
        return "BOOL"  # h5py's bool
    hint = " (Keras 3 marks bfloat16 ones with a dtype attribute; this one has none)" if datatype.cls == OPAQUE else ""
    raise UnsupportedType(
        reader.path,
        f"it holds {datatype.size}-byte {datatype.title} values{hint}, which no safetensors dtype names: "
        "only numbers become tensors (read it with h5py)",
        name,
    )


def dataset_entry(reader: Reader, heap: GlobalHeap, path: tuple[str, ...], messages: list[Message]) -> Hdf5Entry | None:
    """The tensor of the dataset at ``path``; ``None`` for a dataset of no elements at all (a null dataspace)."""
    name = tensor_name(path)
    shown = "/" + "/".join(path)
    last_first = messages[::-1]
    first = dict(zip(map(_KIND, last_first), last_first, strict=True))  # the first message of each kind
    space_message, type_message, layout_message = first.get(DATASPACE), first.get(DATATYPE), first.get(LAYOUT)
    if space_message is None or type_message is None or layout_message is None:
        raise BadStructure(reader.path, "a dataset without a dataspace, datatype and layout message", name)
    space = reader.memo.get((DATASPACE, space_message.data))
    if space is None:  # a model's layers share their shapes: each decoded once
        space = reader.memo[DATASPACE, space_message.data] = read_dataspace(reader, space_message.data)
    if space.null:
        return None
    known = None if type_message.flags & SHARED else reader.memo.get((NAMED, type_message.data))
    if known is None:
        datatype = _datatype(reader, type_message, name)
        dtype = dtype_name(reader, heap, datatype, messages, name)
        if not type_message.flags & SHARED and not (datatype.cls in (OPAQUE, FIXED) and datatype.size == 2):
            reader.memo[NAMED, type_message.data] = (datatype, dtype)  # (a 2-byte one's depends on its attributes)
    else:
        datatype, dtype = known
    itemsize = datatype.size
    shape = space.shape
    nbytes = math.prod(shape) * itemsize
    pipeline = first.get(PIPELINE)
    if pipeline is not None:
        filters = read_filters(reader, pipeline.data)
        if filters:
            raise FilteredDataset(
                reader.path,
                f"it is stored through the {', '.join(filters)} filter{'s' if len(filters) > 1 else ''}, so its bytes "
                "in the file are not its values; stfs serves stored bytes only: write it without compression or "
                "filters (h5py: compression=None, shuffle=False)",
                name,
            )
    if EXTERNAL in first:
        raise UnsupportedStorage(
            reader.path, "its values are in external files, not in this one: write it into the file itself", name
        )
    layout = read_layout(reader, layout_message.data, reader.base + layout_message.address, len(shape))
    if layout.kind == "virtual":
        raise UnsupportedStorage(
            reader.path,
            "it is a virtual dataset (its values are mapped from other datasets): copy it into a real dataset",
            name,
        )
    if layout.kind == "chunked":
        if nbytes == 0:
            return Hdf5Entry(name, dtype, shape, 0, 0, dataset=shown)
        from .chunks import Chunked, chunk_addresses  # gather's numpy only where chunks are

        addresses = chunk_addresses(reader, layout, shape, space.maxshape, itemsize, name)
        chunked = Chunked(shape, layout.chunk, itemsize, tuple(addresses))
        begin = chunked.span[0]  # the lowest chunk: every chunk ends in the file, so begin + nbytes does too
        return Hdf5Entry(name, dtype, shape, begin, begin + nbytes, dataset=shown, chunked=chunked)
    if layout.kind == "compact":
        if layout.size < nbytes:
            raise BadStructure(reader.path, f"its compact data holds {layout.size} of its {nbytes} bytes", name)
        begin = reader.start + layout.address
        return Hdf5Entry(name, dtype, shape, begin, begin + nbytes, dataset=shown)
    if nbytes == 0:
        return Hdf5Entry(name, dtype, shape, 0, 0, dataset=shown)
    if layout.address == reader.undefined:
        raise UnsupportedStorage(
            reader.path, "its values were never written (they read as the fill value): write every value", name
        )
    if 0 <= layout.size < nbytes:
        raise BadStructure(reader.path, f"its contiguous storage holds {layout.size} of its {nbytes} bytes", name)
    if layout.address + nbytes > reader.size - reader.base:
        raise Hdf5Truncated(
            reader.path,
            f"its bytes ({nbytes} at address {layout.address}) run past the end of the file ({reader.size} bytes)",
            name,
        )
    begin = reader.start + reader.base + layout.address
    return Hdf5Entry(name, dtype, shape, begin, begin + nbytes, shown)
