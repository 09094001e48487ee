"""The extensible array that indexes the chunks of a dataset of one unlimited dimension (``maxshape=(None, ...)``
with ``libver="latest"``): its header, index block, secondary blocks and data blocks, as libhdf5 lays them out
(H5EA), each element a chunk's address."""

from __future__ import annotations

from .io import Fields, Reader
from .rules import BadStructure, UnsupportedStorage


class ExtensibleArray:
    """An extensible array of addresses: ``get(index)`` is its element ``index``, ``None`` where never set."""

    def __init__(self, reader: Reader, address: int, name: str) -> None:
        o, n = reader.offset_size, reader.length_size
        head = reader.at(address, 12 + 6 * n + o + 4, "an extensible array header")
        if head[:4] != b"EAHD" or head[4] != 0:
            raise BadStructure(reader.path, f"no extensible array header (EAHD, version 0) at address {address}", name)
        reader.check(head, "the extensible array header", address)
        fields = Fields(reader, head, "an extensible array header", 5)
        client, element, max_bits, index_elements, min_elements, min_pointers, page_bits = (
            fields.u8() for _ in range(7)
        )
        fields.skip(6 * n)
        self.index_block = fields.address()
        if client != 0 or element != o or not 0 < max_bits <= 64 or min_elements == 0 or min_pointers == 0:
            raise BadStructure(reader.path, f"an extensible array of client {client}, elements of {element}", name)
        for value, what in ((min_elements, "data block minimum"), (min_pointers, "secondary block minimum")):
            if value & (value - 1):
                raise BadStructure(reader.path, f"an extensible array whose {what} {value} is no power of two", name)
        self.reader, self.name, self.address = reader, name, address
        self.index_elements, self.page_elements = index_elements, 1 << page_bits
        self.offset_size = (max_bits + 7) // 8  # bytes of a block's offset in the array
        count = 1 + max_bits - (min_elements.bit_length() - 1)
        self.blocks: list[tuple[int, int, int, int]] = []  # each secondary block: data blocks, their elements, first
        start = first_block = 0
        for u in range(max(count, 0)):
            blocks, elements = 1 << (u // 2), (1 << ((u + 1) // 2)) * min_elements
            self.blocks.append((blocks, elements, start, first_block))
            start += blocks * elements
            first_block += blocks
        self.direct_super = 2 * (min_pointers.bit_length() - 1)  # secondary blocks whose data blocks the index holds
        self.direct_blocks = 2 * (min_pointers - 1)
        self.super_count = max(len(self.blocks) - self.direct_super, 0)
        self.checked: dict[int, bytes] = {}  # blocks read and checked, by address

    def _block(self, address: int, size: int, signature: bytes, what: str) -> bytes:
        found = self.checked.get(address)
        if found is not None and len(found) == size:
            return found
        reader = self.reader
        data = reader.at(address, size, f"an extensible array {what}")
        if data[:4] != signature:
            raise BadStructure(
                reader.path, f"no extensible array {what} ({signature.decode()}) at {address}", self.name
            )
        reader.check(data, f"the extensible array {what}", address)
        self.checked[address] = data
        return data

    def _index_block(self) -> bytes:
        o = self.reader.offset_size
        size = 6 + o + (self.index_elements + self.direct_blocks + self.super_count) * o + 4
        return self._block(self.index_block, size, b"EAIB", "index block")

    def _address(self, data: bytes, at: int) -> int | None:
        value = int.from_bytes(data[at : at + self.reader.offset_size], "little")
        return None if value == self.reader.undefined else value

    def get(self, index: int) -> int | None:
        reader, o = self.reader, self.reader.offset_size
        reader.step()
        block = self._index_block()
        if index < self.index_elements:
            return self._address(block, 6 + o + index * o)
        index -= self.index_elements
        which = ((index // self.blocks[0][1]) + 1).bit_length() - 1 if self.blocks else 0
        if which >= len(self.blocks):
            raise BadStructure(reader.path, f"chunk {index} past its extensible array", self.name)
        blocks, elements, start, first_block = self.blocks[which]
        local = index - start
        paged = elements > self.page_elements  # the data block's elements in pages of their own, each checksummed
        if which < self.direct_super:
            if paged:  # libhdf5's defaults (all h5py can write) never page the index block's data blocks
                raise UnsupportedStorage(reader.path, "its index block's data blocks are paged", self.name)
            at = 6 + o + (self.index_elements + first_block + local // elements) * o
            data_block = self._address(block, at)
            bitmap = b""
        else:
            at = 6 + o + (self.index_elements + self.direct_blocks + which - self.direct_super) * o
            secondary = self._address(block, at)
            if secondary is None:
                return None
            prefix = 6 + o + self.offset_size
            pages = elements // self.page_elements if paged else 0
            bitmap_size = blocks * ((pages + 7) // 8)  # each data block's page bits, a byte boundary apart in size
            head = self._block(secondary, prefix + bitmap_size + blocks * o + 4, b"EASB", "secondary block")
            bitmap = head[prefix : prefix + bitmap_size]
            data_block = self._address(head, prefix + bitmap_size + (local // elements) * o)
        if data_block is None:
            return None
        prefix = 6 + o + self.offset_size
        if not paged:
            data = self._block(data_block, prefix + elements * o + 4, b"EADB", "data block")
            return self._address(data, prefix + (local % elements) * o)
        element = local % elements
        page = element // self.page_elements
        bit = (local // elements) * (elements // self.page_elements) + page  # numbered on across the data blocks
        if not bitmap[bit // 8] & (0x80 >> (bit % 8)):
            return None  # a page never written: its chunks were never allocated
        self._block(data_block, prefix + 4, b"EADB", "data block")  # the prefix alone, its checksum its own
        page_size = self.page_elements * o + 4
        page_address = data_block + prefix + 4 + page * page_size
        content = self.checked.get(page_address)
        if content is None:
            content = reader.at(page_address, page_size, "an extensible array data block page")
            reader.check(content, "the extensible array data block page", page_address)
            self.checked[page_address] = content
        return self._address(content, (element % self.page_elements) * o)
