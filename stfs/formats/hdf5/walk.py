"""The walk from the root group to every object: a group's links (a symbol table's B-tree and local heap; link
messages; dense links in a fractal heap indexed by a version 2 B-tree), an object's attributes (messages, or dense),
level by level so that a remote file's object headers of one level are fetched at once. Each object is visited once
(a hard link to a group above is not followed again), by its first path in name order, as h5py's ``visititems``."""

from __future__ import annotations

import functools
import itertools
import operator
import struct
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from . import objects
from .btrees import v1_leaves, v2_records
from .heaps import MAX_NAME, FractalHeap, local_heap
from .io import Reader
from .messages import (
    ATTRIBUTE,
    ATTRIBUTE_INFO,
    LAYOUT,
    LINK,
    LINK_INFO,
    SYMBOL_TABLE,
    Attribute,
    Link,
    read_attribute,
    read_link,
    read_link_info,
    read_symbol_table,
)
from .objects import Message, read_object
from .rules import BadStructure, TooLarge

MAX_OBJECTS = 1_000_000
_NAME = _PATH = _KIND = operator.itemgetter(0)  # a Link's name, a Found's path, a Message's kind
GROUP_KINDS = frozenset((SYMBOL_TABLE, LINK_INFO, LINK))
_new = tuple.__new__  # a Found or Link made without its ``__new__``'s Python frame
PREFETCH = 512  # bytes read ahead at each object header, B-tree node or heap of a level: most fit


class Found(NamedTuple):
    """An object reached by the walk: its path of link names from the root, whether a dataset (one with a layout)
    or a group, its messages."""

    path: tuple[str, ...]
    dataset: bool
    messages: list[Message]


def walk(reader: Reader, root: int) -> list[Found]:
    """Every group and dataset below ``root``, the root group included, in h5py's order (a group's links by name)."""
    found: list[Found] = []
    seen: set[int] = set()
    level: list[tuple[int, tuple[str, ...]]] = [(root, ())]
    while level:
        if reader.batches:
            reader.prefetch([address for address, _ in level], PREFETCH)
        following: list[tuple[int, tuple[str, ...]]] = []
        groups: list[Found] = []
        for address, path in level:
            if address in seen:
                continue
            seen.add(address)
            if len(seen) > MAX_OBJECTS:
                raise TooLarge(reader.path, f"it holds more than {MAX_OBJECTS:,} objects")
            messages = read_object(reader, address)
            kinds = set(map(_KIND, messages))
            if LAYOUT in kinds:
                found.append(_new(Found, (path, True, messages)))
            elif not kinds.isdisjoint(GROUP_KINDS) or not path:
                groups.append(_new(Found, (path, False, messages)))
            # anything else (a committed datatype) is no tensor
        if reader.batches:
            _prefetch_tables(reader, groups)
        for group in groups:
            found.append(group)
            links = group_links(reader, group.messages)
            links.sort(key=_NAME)
            if len(set(map(_NAME, links))) < len(links):  # names are unique: which would h5py's lookup give?
                one = next(one for one, other in itertools.pairwise(links) if one.name == other.name)
                where = "/" + "/".join(group.path)
                raise BadStructure(reader.path, f"the group {where} has two links named {one.name!r}")
            base = group.path
            following += [(link.address, (*base, link.name)) for link in links if link.address is not None]
        level = following
    found.sort(key=_PATH)
    return found


def _prefetch_tables(reader: Reader, groups: list[Found]) -> None:
    """Read the symbol tables of a level's old-style groups at once: their B-tree roots and local heaps, then the
    symbol table nodes of the roots that are leaves (a remote file's in a request each, in parallel)."""
    tables = [
        read_symbol_table(reader, message.data)
        for group in groups
        for message in group.messages
        if message.kind == SYMBOL_TABLE
    ]
    if not tables:
        return
    reader.prefetch([address for table in tables for address in table], PREFETCH)
    nodes = []
    for btree, _ in tables:
        head = reader.at(btree, 8, "a version 1 B-tree node")
        if head[:4] == b"TREE" and head[5] == 0:  # a leaf: its children are symbol table nodes
            nodes += [child for _, child in v1_leaves(reader, btree, 0, reader.length_size)]
    reader.prefetch(nodes, PREFETCH)


def group_links(reader: Reader, messages: list[Message]) -> list[Link]:
    """A group's links, whichever way it keeps them."""
    links: list[Link] = []
    for message in messages:
        kind = message.kind
        if kind == SYMBOL_TABLE:
            links += _symbol_table(reader, message.data)
        elif kind == LINK:
            links.append(read_link(reader, message.data))
        elif kind == LINK_INFO:
            dense = read_link_info(reader, message.data)
            if dense.heap != reader.undefined:
                heap = FractalHeap(reader, dense.heap)
                links += [read_link(reader, heap.get(record[4:])) for record in v2_records(reader, dense.names, 5)]
    return links


_CODES = {2: "H", 4: "I", 8: "Q"}


@functools.cache
def _layouts(offset_size: int, length_size: int) -> tuple[struct.Struct, struct.Struct, struct.Struct]:
    """A symbol table message: its B-tree's address and its local heap's; a version 1 B-tree node's (key, child)
    pairs: the child addresses; a symbol table entry: its name's offset in the local heap, its object header's
    address."""
    o = _CODES[offset_size]
    return struct.Struct(f"<2{o}"), struct.Struct(f"<{length_size}x{o}"), struct.Struct(f"<2{o}24x")


def _symbol_table(reader: Reader, message: bytes) -> list[Link]:
    """The links of an old-style group: its B-tree's symbol table nodes' entries, named from its local heap."""
    o, n = reader.offset_size, reader.length_size
    table, children, entries = _layouts(o, n)
    if len(message) < table.size:
        read_symbol_table(reader, message)  # raises: it ends inside its fields
    btree, heap_address = table.unpack_from(message)
    native = objects.NATIVE
    if native is not None:  # in C: the Python below where it meets anything but a leaf root and whole names
        found = native.symbol_table(reader.window_for, reader.base, message, o, n, MAX_NAME, Link, reader.steps_left)
        if found is not None:
            reader.step(found[1])
            return found[0]
    names = local_heap(reader, heap_address)
    nodes: Iterable[int] | None = None
    if btree != reader.undefined:  # a root that is a leaf and at hand (most are: up to 32 nodes) read here
        reader.step()
        head = reader.upto(btree, 1024, "a version 1 B-tree node", 8 + 2 * o)
        used = head[6] | head[7] << 8
        body = 8 + 2 * o
        if head[:6] == b"TREE\0\0" and body + used * (n + o) + n <= len(head):
            nodes = [child for (child,) in children.iter_unpack(head[body : body + used * (n + o)])]
    if nodes is None:  # any other: v1_leaves walks it (or says what is wrong)
        nodes = (node for _, node in v1_leaves(reader, btree, 0, n))
    entry = entries.size
    find, size = names.find, len(names)
    links: list[Link] = []
    for node in nodes:
        head = reader.upto(node, 1024, "a symbol table node", 8)
        if head[:5] != b"SNOD\1":
            raise BadStructure(reader.path, f"no symbol table node (SNOD, version 1) at address {node}")
        count = head[6] | head[7] << 8
        data = head[8 : 8 + count * entry]
        if len(data) < count * entry:
            data = reader.at(node + 8, count * entry, "a symbol table node")
        reader.step(count)
        if native is not None:
            named = native.symbol_entries(data, o, names, MAX_NAME, Link)
            if type(named) is int:
                raise BadStructure(reader.path, f"no name ends at offset {named} of a local heap of {size} bytes")
            links += named
            continue
        for offset, address in entries.iter_unpack(data):
            end = find(b"\0", offset, offset + MAX_NAME)
            if end < 0 or offset >= size:
                raise BadStructure(reader.path, f"no name ends at offset {offset} of a local heap of {size} bytes")
            links.append(_new(Link, (names[offset:end].decode("utf-8", "surrogateescape"), address, 0)))
    return links


def attributes(reader: Reader, messages: list[Message]) -> Iterator[Attribute]:
    """An object's attributes, from its messages or its dense storage."""
    for message in messages:
        if message.kind == ATTRIBUTE:
            yield read_attribute(reader, message.data)
        elif message.kind == ATTRIBUTE_INFO:
            dense = read_link_info(reader, message.data, attributes=True)
            if dense.heap != reader.undefined:
                heap = FractalHeap(reader, dense.heap)
                for record in v2_records(reader, dense.names, 8):
                    yield read_attribute(reader, heap.get(record[:8]))
