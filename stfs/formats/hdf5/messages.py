"""The header messages a dataset, a group and an attribute are made of, decoded as the specification lays them out:
dataspace, datatype, data layout, filter pipeline, link, link info, attribute info, symbol table, attribute.

The reader's records here and in its other modules are ``NamedTuple``s, not frozen dataclasses: as immutable, and
each costs ``stfs info`` a tenth of the import time (a slotted dataclass of many fields takes 1.5 ms to make)."""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

from .io import Fields, Reader
from .rules import BadStructure

DATASPACE, LINK_INFO, DATATYPE, LINK, EXTERNAL, LAYOUT, PIPELINE, ATTRIBUTE = 0x1, 0x2, 0x3, 0x6, 0x7, 0x8, 0xB, 0xC
ATTRIBUTE_INFO, SYMBOL_TABLE = 0x15, 0x11
SHARED = 0x02  # a message flag: the message is elsewhere (a committed datatype, the shared message heap)
MAX_RANK = 32  # libhdf5's H5S_MAX_RANK

FIXED, FLOAT, TIME, STRING, BITFIELD, OPAQUE, COMPOUND, REFERENCE, ENUM, VLEN, ARRAY = range(11)
CLASS_NAMES = (
    "integer",
    "floating-point",
    "time",
    "string",
    "bitfield",
    "opaque",
    "compound",
    "reference",
    "enum",
    "variable-length",
    "array",
)
FILTER_NAMES = {
    1: "gzip",
    2: "shuffle",
    3: "fletcher32",
    4: "szip",
    5: "nbit",
    6: "scaleoffset",
    32000: "lzf",
    32001: "blosc",
    32004: "lz4",
    32008: "bitshuffle",
    32015: "zstd",
}


class Datatype(NamedTuple):
    """A datatype: its class, size in bytes, ``big`` (big-endian), ``signed``; for a float its exponent and mantissa
    bits; for an opaque type its tag; for an enum its base and members; for a string its padding and character set;
    for a variable-length type whether it is a string and its base."""

    cls: int
    size: int
    big: bool = False
    signed: bool = False
    precision: int = 0
    bit_offset: int = 0
    exponent: int = 0
    mantissa: int = 0
    tag: str = ""
    base: Datatype | None = None
    members: tuple[tuple[str, int], ...] = ()
    padding: int = 0
    charset: int = 0
    vlen_string: bool = False

    @property
    def title(self) -> str:
        if self.cls == VLEN and self.vlen_string:
            return "variable-length string"
        return CLASS_NAMES[self.cls] if self.cls < len(CLASS_NAMES) else f"class {self.cls}"


_NUMBER = struct.Struct("<IIHH")  # class and version with the 3 bytes of bit field, size, offset and precision
_FLOAT = struct.Struct("<BBBBI")


def _float(
    size: int,
    bits: int,
    offset: int,
    precision: int,
    exponent_at: int,
    exponent: int,
    mantissa_at: int,
    mantissa: int,
    bias: int,
) -> Datatype:
    # IEEE's layout (sign above exponent above mantissa, the usual bias, an implied leading 1, no padding bits)
    # or another: a float that is not IEEE's is no dtype's, however wide (libhdf5 converts its values)
    ieee = (
        bits & 0xFF7E == 0x20 | ((8 * size - 1) << 8)
        and mantissa_at == 0
        and exponent_at == mantissa
        and exponent > 1
        and bias == (1 << (exponent - 1)) - 1
        and 1 + exponent + mantissa == 8 * size
    )
    return Datatype(
        FLOAT,
        size,
        big=bool(bits & 1),
        precision=precision,
        bit_offset=offset,
        exponent=exponent if ieee else 0,
        mantissa=mantissa if ieee else 0,
    )


def read_datatype(fields: Fields, depth: int = 0) -> Datatype:
    """The datatype at the cursor (nested ones too, at most 8 deep)."""
    if depth > 8:
        raise BadStructure(fields.reader.path, "a datatype nests more than 8 deep")
    data, pos = fields.data, fields.pos
    if len(data) >= pos + 12 and data[pos] & 0x0F in (FIXED, FLOAT):  # a tensor's: its fields in one go
        word, size, offset, precision = _NUMBER.unpack_from(data, pos)
        cls, bits = word & 0x0F, word >> 8
        fields.pos = pos + 12
        if cls == FIXED:
            return Datatype(
                cls, size, big=bool(bits & 1), signed=bool(bits & 8), precision=precision, bit_offset=offset
            )
        if len(data) < pos + 20:
            raise BadStructure(fields.reader.path, f"{fields.what} ends inside a field at byte {len(data)}")
        exponent_at, exponent, mantissa_at, mantissa, bias = _FLOAT.unpack_from(data, pos + 12)
        fields.pos = pos + 20
        return _float(size, bits, offset, precision, exponent_at, exponent, mantissa_at, mantissa, bias)
    head = fields.u8()
    cls, bits, size = head & 0x0F, fields.uint(3), fields.u32()
    version = head >> 4
    if cls in (FIXED, FLOAT):
        raise BadStructure(fields.reader.path, f"{fields.what} ends inside a field at byte {len(data)}")
    if cls == STRING:
        return Datatype(cls, size, padding=bits & 0x0F, charset=(bits >> 4) & 0x0F)
    if cls == OPAQUE:
        tag = fields.take(bits & 0xFF).split(b"\0", 1)[0].decode("ascii", "replace")
        return Datatype(cls, size, tag=tag)
    if cls == ENUM:
        base = read_datatype(fields, depth + 1)
        count = bits & 0xFFFF
        names = []
        for _ in range(count):
            fields.reader.step()
            start = fields.pos
            while fields.take(1) != b"\0":
                pass
            name = fields.data[start : fields.pos - 1].decode("utf-8", "replace")
            if version < 3:
                fields.skip(-(fields.pos - start) % 8)
            names.append(name)
        values = [fields.uint(base.size) for _ in range(count)]
        return Datatype(cls, size, base=base, members=tuple(zip(names, values, strict=True)))
    if cls == VLEN:
        base = read_datatype(fields, depth + 1)
        return Datatype(cls, size, base=base, vlen_string=(bits & 0x0F) == 1, charset=(bits >> 8) & 0x0F)
    if cls in (TIME, BITFIELD):
        fields.skip(4 if cls == BITFIELD else 2)
    elif cls == ARRAY:
        rank = fields.u8()
        if version < 3:
            fields.skip(3)
        fields.skip(4 * rank * (2 if version < 3 else 1))
        base = read_datatype(fields, depth + 1)
        return Datatype(cls, size, base=base)
    elif cls > ARRAY:
        raise BadStructure(fields.reader.path, f"datatype class {cls}: the specification defines 0 to 10")
    return Datatype(cls, size)  # compound, reference: their properties are not needed to refuse them


class Dataspace(NamedTuple):
    """A dataspace: its shape (empty: a scalar), or ``null`` (no elements at all, h5py's ``Empty``)."""

    shape: tuple[int, ...]
    null: bool = False
    maxshape: tuple[int, ...] = ()  # each dimension's maximum (an unlimited one: all ones), or the shape


def read_dataspace(reader: Reader, data: bytes) -> Dataspace:
    if len(data) < 4:
        raise BadStructure(reader.path, "a dataspace message ends inside its fields")
    version, rank, flags = data[0], data[1], data[2]
    if version not in (1, 2) or rank > MAX_RANK:
        raise BadStructure(reader.path, f"a dataspace of version {version} and rank {rank}")
    null = version == 2 and data[3] == 2
    n = reader.length_size
    at = 8 if version == 1 else 4
    count = rank * (2 if flags & 1 else 1)
    if at + count * n > len(data):
        raise BadStructure(reader.path, "a dataspace message ends inside its dimensions")
    sizes = [int.from_bytes(data[i : i + n], "little") for i in range(at, at + count * n, n)]
    shape = tuple(sizes[:rank])
    return Dataspace(shape, null, tuple(sizes[rank:]) if flags & 1 else shape)


_new = tuple.__new__


class Layout(NamedTuple):
    """A data layout: ``compact`` (its bytes in the message, at ``address``: a file address), ``contiguous`` (at
    ``address``, ``size`` bytes), ``chunked`` (``chunk`` dimensions, an index of ``indexing`` kind at ``address`` with
    its ``params``), or ``virtual``."""

    kind: str
    address: int
    size: int = 0
    chunk: tuple[int, ...] = ()
    indexing: int = 0  # 0: a version 1 B-tree (layouts 1 to 3); 1 to 5 as layout 4's chunk indexing type
    params: tuple[int, ...] = ()
    single_filtered: tuple[int, int] | None = None


def read_layout(reader: Reader, data: bytes, where: int, rank: int) -> Layout:
    """The layout message ``data`` whose first byte is at file address ``where`` (a compact dataset's data)."""
    if len(data) >= 2 and data[0] in (3, 4) and data[1] == 1:  # contiguous: a tensor's, most often
        o, n = reader.offset_size, reader.length_size
        if len(data) >= 2 + o + n:
            address = int.from_bytes(data[2 : 2 + o], "little")
            size = int.from_bytes(data[2 + o : 2 + o + n], "little")
            return _new(Layout, ("contiguous", address, size, (), 0, (), None))  # as Layout(...) makes it, faster
    fields = Fields(reader, data, "a data layout message")
    version = fields.u8()
    if version in (1, 2):
        dims, cls = fields.u8(), fields.u8()
        fields.skip(5)
        address = fields.address() if cls != 0 else reader.undefined
        sizes = tuple(fields.u32() for _ in range(dims))
        if cls == 2:
            fields.u32()  # element size
            return Layout("chunked", address, chunk=sizes[:rank])
        if cls == 0:
            size = fields.u32()
            return Layout("compact", where + fields.pos, size)
        return Layout("contiguous", address, -1)  # its size: the dataspace's elements times the type's
    if version not in (3, 4):
        raise BadStructure(reader.path, f"a data layout message of version {version} (1 to 4)")
    cls = fields.u8()
    if cls == 0:
        size = fields.u16()
        return Layout("compact", where + fields.pos, size)
    if cls == 1:
        return Layout("contiguous", fields.address(), fields.length())
    if cls == 3:
        return Layout("virtual", reader.undefined)
    if cls != 2:
        raise BadStructure(reader.path, f"data layout class {cls} (0 to 3)")
    if version == 3:
        dims = fields.u8()
        address = fields.address()
        sizes = tuple(fields.u32() for _ in range(dims))
        return Layout("chunked", address, chunk=sizes[:rank])
    flags, dims, encoded = fields.u8(), fields.u8(), fields.u8()
    if not 1 <= encoded <= 8:
        raise BadStructure(reader.path, f"chunk dimensions encoded in {encoded} bytes (1 to 8)")
    sizes = tuple(fields.uint(encoded) for _ in range(dims))
    index = fields.u8()
    params: tuple[int, ...] = ()
    single: tuple[int, int] | None = None
    if index == 1 and flags & 2:
        single = (fields.length(), fields.u32())
    elif index == 3:
        params = (fields.u8(),)
    elif index == 4:
        params = tuple(fields.u8() for _ in range(5))
    elif index == 5:
        params = (fields.u32(), fields.u8(), fields.u8())
    elif index not in (1, 2):
        raise BadStructure(reader.path, f"chunk indexing type {index} (1 to 5)")
    return Layout(
        "chunked", fields.address(), chunk=sizes[:rank], indexing=index, params=params, single_filtered=single
    )


def read_filters(reader: Reader, data: bytes) -> list[str]:
    """The names of a filter pipeline's filters (their numbers where not known)."""
    fields = Fields(reader, data, "a filter pipeline message")
    version, count = fields.u8(), fields.u8()
    if version == 1:
        fields.skip(6)
    names = []
    for _ in range(count):
        fields.reader.step()
        ident = fields.u16()
        name_length = fields.u16() if version == 1 or ident >= 256 else 0
        fields.u16()  # flags
        values = fields.u16()
        name = fields.take(name_length).split(b"\0", 1)[0].decode("ascii", "replace")
        if version == 1:
            fields.skip(-name_length % 8)
        fields.skip(4 * values + (4 if version == 1 and values % 2 else 0))
        names.append(FILTER_NAMES.get(ident) or name or f"filter {ident}")
    return names


class Link(NamedTuple):
    """A link of a group: its name, and for a hard link the object header it leads to (``None``: a soft or
    external link, which names an object by its path)."""

    name: str
    address: int | None
    order: int = 0


def read_link(reader: Reader, data: bytes) -> Link:
    fields = Fields(reader, data, "a link message")
    version, flags = fields.u8(), fields.u8()
    if version != 1:
        raise BadStructure(reader.path, f"a link message of version {version} (1)")
    kind = fields.u8() if flags & 0x08 else 0
    order = fields.u64() if flags & 0x04 else 0
    if flags & 0x10:
        fields.u8()  # the name's character set
    length = fields.uint(1 << (flags & 3))
    name = fields.take(length).decode("utf-8", "surrogateescape")
    return Link(name, fields.address() if kind == 0 else None, order)


class Dense(NamedTuple):
    """Where a group's links (or an object's attributes) are kept densely: a fractal heap and the v2 B-tree that
    indexes them by name (undefined addresses: kept in the object header instead)."""

    heap: int
    names: int


def read_link_info(reader: Reader, data: bytes, attributes: bool = False) -> Dense:
    fields = Fields(reader, data, "an attribute info message" if attributes else "a link info message")
    fields.u8()  # version 0
    flags = fields.u8()
    if flags & 1:
        fields.skip(2 if attributes else 8)  # the largest creation index
    return Dense(fields.address(), fields.address())


def read_symbol_table(reader: Reader, data: bytes) -> tuple[int, int]:
    """A symbol table message: (its v1 B-tree's address, its local heap's)."""
    o = reader.offset_size
    if len(data) < 2 * o:
        raise BadStructure(reader.path, "a symbol table message ends inside its fields")
    return int.from_bytes(data[:o], "little"), int.from_bytes(data[o : 2 * o], "little")


class Attribute(NamedTuple):
    """An attribute: its name, datatype, dataspace and raw bytes."""

    name: str
    datatype: Datatype
    space: Dataspace
    data: bytes


def read_attribute(reader: Reader, data: bytes) -> Attribute:
    fields = Fields(reader, data, "an attribute message")
    version, flags = fields.u8(), fields.u8()
    if version not in (1, 2, 3):
        raise BadStructure(reader.path, f"an attribute message of version {version} (1 to 3)")
    if flags & 3:
        raise BadStructure(reader.path, "an attribute with a shared datatype or dataspace")
    name_size, type_size, space_size = fields.u16(), fields.u16(), fields.u16()
    if version == 3:
        fields.u8()  # the name's character set
    align = 8 if version == 1 else 1  # version 1 pads each part to a multiple of 8 bytes
    name = fields.take(name_size).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
    fields.skip(-name_size % align)
    datatype = read_datatype(Fields(reader, fields.take(type_size), "an attribute's datatype"))
    fields.skip(-type_size % align)
    space = read_dataspace(reader, fields.take(space_size))
    fields.skip(-space_size % align)
    count = 0 if space.null else math.prod(space.shape)
    if count * datatype.size > fields.left or (count and datatype.size == 0):
        raise BadStructure(reader.path, f"attribute {name!r} holds fewer bytes than its {count} values need")
    return Attribute(name, datatype, space, fields.take(count * datatype.size))
