"""HDF5's heaps: a local heap (an old-style group's link names), the global heap (variable-length strings of
attributes), and a fractal heap (a new-style group's dense links and attributes), read by address, each walk
bounded."""

from __future__ import annotations

from typing import NamedTuple

from .io import Fields, Reader
from .rules import BadStructure, UnsupportedStorage

MAX_NAME = 1 << 16  # bytes of a link name in a local heap


def local_heap(reader: Reader, address: int) -> bytes:
    """The data segment of the local heap at ``address``: an old-style group's link names, each found in it by
    offset (read once a group)."""
    o, n = reader.offset_size, reader.length_size
    head = reader.at(address, 8 + 2 * n + o, "a local heap")
    if head[:5] != b"HEAP\0":
        raise BadStructure(reader.path, f"no local heap (HEAP, version 0) at address {address}")
    size = int.from_bytes(head[8 : 8 + n], "little")
    start = int.from_bytes(head[8 + 2 * n : 8 + 2 * n + o], "little")
    return reader.at(start, size, "a local heap's data segment")


class GlobalHeap:
    """The global heap's collections, read once each: the objects a variable-length string points to."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        self.collections: dict[int, dict[int, bytes]] = {}

    def object(self, address: int, index: int) -> bytes:
        found = self.collections.get(address)
        if found is None:
            found = self.collections[address] = self._read(address)
        if index not in found:
            raise BadStructure(self.reader.path, f"no object {index} in the global heap collection at {address}")
        return found[index]

    def _read(self, address: int) -> dict[int, bytes]:
        reader = self.reader
        head = reader.at(address, 8 + reader.length_size, "a global heap collection")
        if head[:4] != b"GCOL" or head[4] != 1:
            raise BadStructure(reader.path, f"no global heap collection (GCOL, version 1) at address {address}")
        size = Fields(reader, head, "a global heap collection", 8).length()
        fields = Fields(reader, reader.at(address, size, "a global heap collection"), "a global heap collection")
        fields.pos = 8 + reader.length_size
        objects: dict[int, bytes] = {}
        while fields.left >= 8 + reader.length_size:
            reader.step()
            index = fields.u16()
            fields.skip(6)  # reference count, reserved
            length = fields.length()
            if index == 0:
                break  # free space: the rest of the collection
            objects[index] = fields.take(length)
            fields.skip(min(-length % 8, fields.left))
        return objects


class _Table(NamedTuple):
    width: int
    start: int  # the starting block size
    max_direct: int
    offset_size: int  # bytes of a heap offset (in block headers and managed IDs)
    length_size: int  # bytes of a managed object's length in its ID
    checksummed: bool
    filtered: bool
    root: int
    rows: int

    def row_size(self, row: int) -> int:
        return self.start if row == 0 else self.start << (row - 1)

    @property
    def direct_rows(self) -> int:
        return (self.max_direct.bit_length() - 1) - (self.start.bit_length() - 1) + 2


def _encoded_size(value: int) -> int:
    """libhdf5's H5VM_limit_enc_size: bytes that hold ``value``."""
    return (max(value, 1).bit_length() - 1) // 8 + 1


class FractalHeap:
    """A fractal heap: objects found by their heap IDs (managed objects in direct blocks through the doubling table
    of indirect blocks, tiny objects in the ID itself)."""

    def __init__(self, reader: Reader, address: int) -> None:
        self.reader = reader
        o, n = reader.offset_size, reader.length_size
        size = 4 + 1 + 2 + 2 + 1 + 4 + n + o + n + o + n + n + n + n + n + n + n + n + 2 + n + n + 2 + 2 + o + 2
        head = reader.at(address, size, "a fractal heap header")
        if head[:4] != b"FRHP" or head[4] != 0:
            raise BadStructure(reader.path, f"no fractal heap header (FRHP, version 0) at address {address}")
        fields = Fields(reader, head, "a fractal heap header", 5)
        self.id_length, filters, flags = fields.u16(), fields.u16(), fields.u8()
        max_managed = fields.u32()
        fields.skip(n + o + n + o + n + n + n + n + n + n + n + n)
        width, start, max_direct, max_bits, _, root, rows = (
            fields.u16(),
            fields.length(),
            fields.length(),
            fields.u16(),
            fields.u16(),
            fields.address(),
            fields.u16(),
        )
        full = reader.at(address, size + (n + 4 + filters if filters else 0) + 4, "a fractal heap header")
        reader.check(full, "the fractal heap header", address)
        for value, what in (
            (start, "starting block size"),
            (max_direct, "maximum direct block size"),
            (width, "width"),
        ):
            if value < 1 or value & (value - 1):
                raise BadStructure(reader.path, f"a fractal heap whose {what} {value} is not a power of two")
        if max_direct < start or not 0 < max_bits <= 64:
            raise BadStructure(reader.path, f"a fractal heap of sizes {start}..{max_direct}, {max_bits} bits")
        offset_size = (max_bits + 7) // 8
        length_size = min((max_direct.bit_length() - 1 + 7) // 8, _encoded_size(max_managed))
        self.table = _Table(
            width, start, max_direct, offset_size, length_size, bool(flags & 2), bool(filters), root, rows
        )
        self.address = address

    def get(self, heap_id: bytes) -> bytes:
        """The object whose heap ID is ``heap_id``."""
        reader, table = self.reader, self.table
        if not heap_id:
            raise BadStructure(reader.path, "an empty fractal heap ID")
        kind = (heap_id[0] >> 4) & 3
        if kind == 2:  # tiny: in the ID itself
            if self.id_length > 18:
                length = ((heap_id[0] & 0x0F) << 8 | heap_id[1]) + 1
                return heap_id[2 : 2 + length]
            return heap_id[1 : 1 + (heap_id[0] & 0x0F) + 1]
        if kind != 0:
            raise UnsupportedStorage(reader.path, "a fractal heap's huge object (a link or attribute of many MiB)")
        fields = Fields(reader, heap_id, "a fractal heap ID", 1)
        offset, length = fields.uint(table.offset_size), fields.uint(table.length_size)
        if table.filtered:
            raise UnsupportedStorage(reader.path, "a fractal heap stored through filters")
        block, block_offset = self._direct_block(offset)
        prefix = 5 + reader.offset_size + table.offset_size
        at = offset - block_offset
        if at < prefix + (4 if table.checksummed else 0) or length == 0:
            raise BadStructure(reader.path, f"a fractal heap object at offset {offset} inside its block's header")
        return reader.at(block + at, length, "a fractal heap object")

    def _direct_block(self, offset: int) -> tuple[int, int]:
        """The address of the direct block holding heap offset ``offset``, and that block's own heap offset."""
        reader, table = self.reader, self.table
        if table.root == reader.undefined:
            raise BadStructure(reader.path, "a fractal heap with no root block holds an object")
        if table.rows == 0:
            if offset >= table.start:
                raise BadStructure(reader.path, f"offset {offset} past a fractal heap's one direct block")
            return table.root, 0
        block, rows, block_offset = table.root, table.rows, 0
        seen: set[int] = set()
        while True:
            reader.step()
            if block in seen or block == reader.undefined:
                raise BadStructure(reader.path, f"a fractal heap's indirect blocks come back to {block}")
            seen.add(block)
            row, row_start = 0, block_offset
            while row < rows and offset >= row_start + table.width * table.row_size(row):
                row_start += table.width * table.row_size(row)
                row += 1
            if row >= rows:
                raise BadStructure(reader.path, f"offset {offset} past a fractal heap's indirect block at {block}")
            column = (offset - row_start) // table.row_size(row)
            child = self._entry(block, rows, row * table.width + column)
            child_offset = row_start + column * table.row_size(row)
            if row < table.direct_rows:
                return child, child_offset
            size = table.row_size(row)
            rows = (size.bit_length() - 1) - ((table.start * table.width).bit_length() - 1) + 1
            block, block_offset = child, child_offset

    def _entry(self, block: int, rows: int, index: int) -> int:
        reader, table = self.reader, self.table
        prefix = 5 + reader.offset_size + table.offset_size
        head = reader.at(block, prefix, "a fractal heap indirect block")
        if head[:4] != b"FHIB":
            raise BadStructure(reader.path, f"no fractal heap indirect block (FHIB) at address {block}")
        direct = min(rows, table.direct_rows) * table.width
        at = (
            prefix + index * reader.offset_size
            if index < direct
            else (prefix + direct * reader.offset_size + (index - direct) * reader.offset_size)
        )
        return Fields(reader, reader.at(block + at, reader.offset_size, "a fractal heap indirect block"), "").address()
