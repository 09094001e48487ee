"""The superblock (versions 0 to 3) and object headers (versions 1 and 2, with their continuation blocks): where the
root group is, and each object's messages (type, flags, bytes, and where those bytes lie in the file)."""

from __future__ import annotations

import os
import struct
from types import ModuleType
from typing import NamedTuple

from .io import Fields, Reader
from .rules import BadStructure, BadSuperblock, Hdf5Truncated, NoSuperblock

SIGNATURE = b"\x89HDF\r\n\x1a\n"
NIL = 0x00
CONTINUATION = 0x10
MAX_CONTINUATIONS = 10_000  # blocks of one object header
MAX_MESSAGES = 100_000  # messages of one object header


def _native() -> ModuleType | None:
    """The walk's loops in C (``_scan.c``), unless not built (no compiler) or ``STFS_NATIVE=0`` asks for Python's."""
    if os.environ.get("STFS_NATIVE") == "0":
        return None
    try:
        from . import _scan
    except ImportError:
        return None
    return _scan


NATIVE = _native()


def find_superblock(reader: Reader) -> int:
    """The superblock's position: the first of 0, 512, 1024, 2048, ... that holds the signature."""
    position = 0
    while position + len(SIGNATURE) <= reader.size:
        if reader.raw(position, len(SIGNATURE), "the superblock") == SIGNATURE:
            return position
        position = 512 if position == 0 else position * 2
    raise NoSuperblock(reader.path, "no HDF5 superblock signature at byte 0, 512, 1024, ...: not an HDF5 file")


class Superblock(NamedTuple):
    """What the reader needs of a superblock: its version and where the root group's object header is (versions 0
    and 1 also cache the root's symbol table, which the object header holds as well)."""

    version: int
    root: int
    end_of_file: int


def read_superblock(reader: Reader) -> Superblock:
    """Read the superblock and set the reader's sizes of offsets and lengths and its base address."""
    position = find_superblock(reader)
    head = reader.raw(position, 16, "the superblock")
    version = head[8]
    if version > 3:
        raise BadSuperblock(reader.path, f"superblock version {version}: the specification defines 0 to 3")
    if version < 2:
        offset_size, length_size = head[13], head[14]
    else:
        offset_size, length_size = head[9], head[10]
    if offset_size not in (2, 4, 8) or length_size not in (2, 4, 8):
        raise BadSuperblock(reader.path, f"sizes of offsets {offset_size} and lengths {length_size} (2, 4 or 8 each)")
    reader.set_sizes(position, offset_size, length_size)
    if version < 2:
        fixed = 24 + (4 if version == 1 else 0)
        size = fixed + 4 * offset_size + 2 * offset_size + 24
        fields = Fields(reader, reader.raw(position, size, "the superblock"), "the superblock", fixed)
        fields.address()  # base address: libhdf5 takes the superblock's position instead
        fields.address()  # free-space information
        end_of_file = fields.address()
        fields.address()  # driver information block
        fields.address()  # the root's link name offset
        root = fields.address()
    else:
        size = 12 + 4 * offset_size + 4
        data = reader.raw(position, size, "the superblock")
        reader.check(data, "the superblock", 0)
        fields = Fields(reader, data, "the superblock", 12)
        fields.address()  # base address
        fields.address()  # superblock extension
        end_of_file = fields.address()
        root = fields.address()
    if end_of_file > reader.size:  # libhdf5 refuses such a file as truncated (its end counts the user block too)
        raise Hdf5Truncated(
            reader.path,
            f"its superblock says the file is {end_of_file} bytes long, but it has {reader.size}: "
            "the file was cut short (copy or download it again)",
        )
    return Superblock(version, root, end_of_file)


class Message(NamedTuple):
    """One header message: its ``kind`` (the specification's message type), flags, bytes, and the address of its
    first byte (a compact dataset's data lies in its layout message). A tuple: hundreds of thousands are made."""

    kind: int
    flags: int
    data: bytes
    address: int


_new = tuple.__new__  # a Message made without its ``__new__``'s Python frame
_V1_MESSAGE = struct.Struct("<HHB")  # a version 1 message's type, size and flags


def read_object(reader: Reader, address: int) -> list[Message]:
    """The messages of the object header at ``address``, its continuation blocks' included, in order."""
    if address == reader.undefined:
        raise BadStructure(reader.path, "an object header address is undefined")
    first = reader.upto(address, 512, "an object header", 16)
    if first[:4] == b"OHDR":
        return _version2(reader, address)
    if first[0] != 1:
        raise BadStructure(reader.path, f"the object header at address {address} has version {first[0]} (1 or 2)")
    size = int.from_bytes(first[8:12], "little")
    if 16 + size <= len(first):  # at hand: most are, and without a continuation, read in one loop here
        short = (
            _short(first, 16 + size, address)
            if NATIVE is None
            else NATIVE.v1_messages(first, 16 + size, address, Message)
        )
        if short is not None:
            reader.step(1 + short[1])
            return short[0]
    messages: list[Message] = []
    blocks = [(address + 16, size)]
    seen: set[int] = set()
    unpack = _V1_MESSAGE.unpack_from
    while blocks:
        start, length = blocks.pop(0)
        reader.step()
        if start == address + 16 and 16 + length <= len(first):
            data = first[16 : 16 + length]
        else:
            data = reader.at(start, length, "an object header")
        pos = 0
        count = 0
        while pos + 8 <= length:
            kind, msize, flags = unpack(data, pos)
            body = pos + 8
            end = body + msize
            if end > length:
                raise BadStructure(reader.path, f"a message of the object header at address {address} ends past it")
            count += 1
            if kind == CONTINUATION or len(messages) >= MAX_MESSAGES:
                _add(reader, messages, kind, flags, data[body:end], start + body, blocks, seen, address)
            elif kind != NIL:  # padding: nothing reads it
                messages.append(_new(Message, (kind, flags, data[body:end], start + body)))
            pos = end
        reader.step(count)
    return messages


def _short(first: bytes, length: int, address: int) -> tuple[list[Message], int] | None:
    """The messages of a version 1 object header's first block, ``first[16:length]``, and the number of messages read
    last; ``None`` where it continues elsewhere or a message ends past it (``read_object`` walks it then)."""
    unpack = _V1_MESSAGE.unpack_from
    messages: list[Message] = []
    pos = 16
    count = 0
    while pos + 8 <= length:
        kind, size, flags = unpack(first, pos)
        end = pos + 8 + size
        if end > length or kind == CONTINUATION:
            return None
        if kind != NIL:  # padding: nothing reads it
            messages.append(_new(Message, (kind, flags, first[pos + 8 : end], address + pos + 8)))
        count += 1
        pos = end
    return messages, count


def _add(
    reader: Reader,
    messages: list[Message],
    kind: int,
    flags: int,
    body: bytes,
    where: int,
    blocks: list[tuple[int, int]],
    seen: set[int],
    address: int,
) -> None:
    reader.step()
    if len(messages) >= MAX_MESSAGES:
        raise BadStructure(reader.path, f"the object header at address {address} has more than {MAX_MESSAGES} messages")
    if kind == CONTINUATION:
        fields = Fields(reader, body, "a continuation message")
        block, length = fields.address(), fields.length()
        if block in seen or block == address or len(seen) >= MAX_CONTINUATIONS:
            raise BadStructure(reader.path, f"the object header at address {address} continues where it was")
        seen.add(block)
        blocks.append((block, length))
        return
    if kind != NIL:
        messages.append(_new(Message, (kind, flags, body, where)))


def _version2(reader: Reader, address: int) -> list[Message]:
    available = max(0, min(64, reader.size - reader.base - address))
    fields = Fields(reader, reader.at(address, available, "an object header"), "an object header", 4)
    version, flags = fields.u8(), fields.u8()
    if version != 2:
        raise BadStructure(reader.path, f"the object header at address {address} has version {version} (2)")
    if flags & 0x20:
        fields.skip(16)  # access, modification, change and birth times
    if flags & 0x10:
        fields.skip(4)  # attribute storage phase change values
    size = fields.uint(1 << (flags & 3))
    prefix = fields.pos
    order = bool(flags & 0x04)  # messages carry their creation order
    messages: list[Message] = []
    seen: set[int] = set()
    blocks: list[tuple[int, int]] = []
    data = reader.at(address, prefix + size + 4, "an object header")
    reader.check(data, "the object header", address)
    _messages2(reader, data, prefix, prefix + size, address, order, messages, blocks, seen)
    while blocks:
        start, length = blocks.pop(0)
        reader.step()
        data = reader.at(start, length, "an object header continuation block")
        if data[:4] != b"OCHK" or length < 8:
            raise BadStructure(reader.path, f"no continuation block (OCHK) at address {start}")
        reader.check(data, "the continuation block", start)
        _messages2(reader, data, 4, length - 4, start, order, messages, blocks, seen, address)
    return messages


def _messages2(
    reader: Reader,
    data: bytes,
    pos: int,
    end: int,
    start: int,
    order: bool,
    messages: list[Message],
    blocks: list[tuple[int, int]],
    seen: set[int],
    owner: int | None = None,
) -> None:
    head = 6 if order else 4
    while pos + head <= end:
        kind, msize, flags = data[pos], data[pos + 1] | data[pos + 2] << 8, data[pos + 3]
        body = pos + head
        if body + msize > end:
            raise BadStructure(reader.path, f"a message of the object header at address {start} ends past it")
        _add(reader, messages, kind, flags, data[body : body + msize], start + body, blocks, seen, owner or start)
        pos = body + msize
