"""A chunked dataset without filters: where its chunks are (a version 1 B-tree, or a version 4 layout's index: a
single chunk, implicit, a fixed array, a version 2 B-tree), and its bytes in C order gathered from them as read
(``Chunked``, the format seam's ``Scattered``).

Every chunk is stored whole, its ``chunk`` dimensions in C order, even where it crosses the dataset's edge: the
elements of a tensor row that one chunk holds are one run of that chunk.
"""

from __future__ import annotations

import array
import itertools
import math
from dataclasses import dataclass, field

from ..base import Read, Rows
from ..gather import GATHER_ELEMENTS, gather_positions
from .btrees import v1_leaves, v2_records
from .io import Fields, Reader
from .messages import Layout
from .rules import BadStructure, UnsupportedStorage

MAX_CHUNKS = 1_000_000  # chunks of one dataset: their addresses are kept
UNLIMITED = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Chunked:
    """A tensor of ``shape`` stored in chunks of ``chunk`` elements each way, the chunk at grid position ``g`` (C
    order over the grid of ``ceil(shape / chunk)``) at the absolute file offset ``addresses[g]``."""

    shape: tuple[int, ...]
    chunk: tuple[int, ...]
    itemsize: int
    addresses: tuple[int, ...]
    packed: bytes = field(default=b"", repr=False, compare=False)  # the addresses as int64s, for numpy without a copy

    def __post_init__(self) -> None:
        object.__setattr__(self, "packed", array.array("q", self.addresses).tobytes())

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(-(-n // c) for n, c in zip(self.shape, self.chunk, strict=True))

    @property
    def chunk_bytes(self) -> int:
        return math.prod(self.chunk) * self.itemsize

    @property
    def offset(self) -> int:
        return self.addresses[0] if self.addresses else 0

    @property
    def span(self) -> tuple[int, int]:
        if not self.addresses:
            return (0, 0)
        first = min(self.addresses)
        return (first, max(self.addresses) + self.chunk_bytes - first)

    def read_into(self, read: Read, begin: int, view: memoryview) -> None:
        """Fill ``view`` with its bytes from ``begin``: ``GATHER_ELEMENTS`` elements at a time, each element's place
        in its chunk worked out, the places read in order (``gather_positions``)."""
        import numpy as np

        size = self.itemsize
        addresses = np.frombuffer(self.packed, dtype=np.int64)
        grid = self.grid
        end = begin + len(view)
        done = 0
        while begin + done < end:
            first = (begin + done) // size
            last = min((end - 1) // size, first + GATHER_ELEMENTS - 1)
            index = np.arange(first, last + 1, dtype=np.int64)
            cell = np.zeros(index.shape, dtype=np.int64)  # the chunk's position in the grid
            inner = np.zeros(index.shape, dtype=np.int64)  # the element's in its chunk
            cell_step = inner_step = 1
            for n, c, g in zip(reversed(self.shape), reversed(self.chunk), reversed(grid), strict=True):
                at = index % n
                index //= n
                cell += (at // c) * cell_step
                inner += (at % c) * inner_step
                cell_step *= g
                inner_step *= c
            positions = addresses[cell] + inner * size
            out = gather_positions(read, 0, positions, size)
            chunk = memoryview(out.view(np.uint8).data)
            skip = begin + done - first * size
            length = min(end - begin - done, len(chunk) - skip)
            view[done : done + length] = chunk[skip : skip + length]
            done += length

    def layout(self, limit: int) -> tuple[Rows | bytes, ...] | str:
        """Its bytes as ``Rows``: for each index of its dimensions before the last two and each row of chunks along
        the second last, the rows that chunk row holds, each the run of every chunk along the last dimension."""
        size, shape, chunk, grid = self.itemsize, self.shape, self.chunk, self.grid
        if 0 in shape:
            return ()
        if len(shape) == 1:
            if grid[0] > limit:
                return f"it is more than {limit} runs"
            runs = [min(chunk[0], shape[0] - j * chunk[0]) * size for j in range(grid[0])]
            return (Rows(1, tuple((None, self.addresses[j], run, run) for j, run in enumerate(runs))),)
        outer = shape[:-2]
        if math.prod(outer) * grid[-2] * grid[-1] > limit:
            return f"it is more than {limit} runs"
        blocks: list[Rows | bytes] = []
        plane = chunk[-2] * chunk[-1]
        for index in itertools.product(*(range(n) for n in outer)):
            cell_outer = 0
            local = 0
            for i, c, g in zip(index, chunk[:-2], grid[:-2], strict=True):
                cell_outer = cell_outer * g + i // c
                local = local * c + i % c
            for r in range(grid[-2]):
                rows = min(chunk[-2], shape[-2] - r * chunk[-2])
                parts: list[tuple[str | None, int, int, int]] = []
                for c in range(grid[-1]):
                    cell = (cell_outer * grid[-2] + r) * grid[-1] + c
                    run = min(chunk[-1], shape[-1] - c * chunk[-1]) * size
                    parts.append((None, self.addresses[cell] + local * plane * size, run, chunk[-1] * size))
                blocks.append(Rows(rows, tuple(parts)))
        return tuple(blocks)


def chunk_addresses(
    reader: Reader, layout: Layout, shape: tuple[int, ...], maxshape: tuple[int, ...], itemsize: int, name: str
) -> list[int]:
    """The absolute file offset of every chunk of a dataset, in C order over its grid; refused where one was never
    written or lies past the end of the file."""
    chunk = layout.chunk
    if len(chunk) != len(shape) or any(c == 0 for c in chunk):
        raise BadStructure(reader.path, f"chunk dimensions {list(chunk)} for shape {list(shape)}", name)
    grid = tuple(-(-n // c) for n, c in zip(shape, chunk, strict=True))
    count = math.prod(grid)
    if count > MAX_CHUNKS:
        raise UnsupportedStorage(reader.path, f"it has {count:,} chunks, more than stfs reads ({MAX_CHUNKS:,})", name)
    nbytes = math.prod(chunk) * itemsize
    found: list[int | None] = [None] * count
    if count == 0 or layout.address == reader.undefined:
        pass
    elif layout.indexing == 0:
        _btree_v1(reader, layout.address, chunk, grid, nbytes, found, name)
    elif layout.indexing == 1:
        if layout.single_filtered is not None:
            raise BadStructure(reader.path, "a single chunk marked filtered in a dataset without filters", name)
        found[0] = layout.address
    elif layout.indexing == 2:
        found[:] = [layout.address + i * nbytes for i in range(count)]
    elif layout.indexing == 3:
        _fixed_array(reader, layout.address, found, name)
    elif layout.indexing == 4:
        _extensible(reader, layout.address, chunk, grid, maxshape, found, name)
    elif layout.indexing == 5:
        _btree_v2(reader, layout.address, grid, found)
    else:
        raise BadStructure(reader.path, f"chunk index type {layout.indexing}", name)
    missing = sum(address is None for address in found)
    if missing:
        raise UnsupportedStorage(
            reader.path,
            f"{missing} of its {count} chunks were never written (they read as the fill value): write every value",
            name,
        )
    out = []
    for address in found:
        assert address is not None
        if address + nbytes > reader.size - reader.base:
            raise BadStructure(reader.path, f"a chunk at address {address} runs past the end of the file", name)
        out.append(reader.absolute(address))
    return out


def _cell(reader: Reader, offsets: tuple[int, ...], grid: tuple[int, ...], name: str) -> int:
    cell = 0
    for o, g in zip(offsets, grid, strict=True):
        if o >= g:
            raise BadStructure(reader.path, f"a chunk at grid position {list(offsets)} outside {list(grid)}", name)
        cell = cell * g + o
    return cell


def _place(reader: Reader, found: list[int | None], cell: int, address: int, name: str) -> None:
    if found[cell] is not None:
        raise BadStructure(reader.path, f"two chunks at one place of the grid (chunk {cell})", name)
    found[cell] = address


def _btree_v1(
    reader: Reader,
    root: int,
    chunk: tuple[int, ...],
    grid: tuple[int, ...],
    nbytes: int,
    found: list[int | None],
    name: str,
) -> None:
    rank = len(chunk)
    key_size = 8 + 8 * (rank + 1)
    for key, address in v1_leaves(reader, root, 1, key_size):
        fields = Fields(reader, key, "a chunk's B-tree key")
        size, mask = fields.u32(), fields.u32()
        offsets = tuple(fields.u64() for _ in range(rank))
        if fields.u64():  # the element's dimension: always 0 (libhdf5 finds no chunk at another)
            raise BadStructure(reader.path, "a chunk's key has an offset in its element dimension", name)
        if mask or size != nbytes:
            raise BadStructure(reader.path, f"a chunk of {size} bytes (filter mask {mask}) where {nbytes} belong", name)
        if any(o % c for o, c in zip(offsets, chunk, strict=True)):
            raise BadStructure(reader.path, f"a chunk at offsets {list(offsets)}, not on the chunk grid", name)
        scaled = tuple(o // c for o, c in zip(offsets, chunk, strict=True))
        _place(reader, found, _cell(reader, scaled, grid, name), address, name)


def _fixed_array(reader: Reader, address: int, found: list[int | None], name: str) -> None:
    o, n = reader.offset_size, reader.length_size
    head = reader.at(address, 8 + n + o + 4, "a fixed array header")
    if head[:4] != b"FAHD" or head[4] != 0:
        raise BadStructure(reader.path, f"no fixed array header (FAHD, version 0) at address {address}", name)
    reader.check(head, "the fixed array header", address)
    fields = Fields(reader, head, "a fixed array header", 5)
    client, entry_size, page_bits = fields.u8(), fields.u8(), fields.u8()
    entries, block = fields.length(), fields.address()
    if client != 0 or entry_size != o or entries != len(found) or page_bits > 32:
        raise BadStructure(reader.path, f"a fixed array of {entries} entries of {entry_size} bytes", name)
    prefix = 6 + o
    page = 1 << page_bits
    if entries <= page:
        data = reader.at(block, prefix + entries * o + 4, "a fixed array data block")
        _fixed_block(reader, data, block, name)
        values = Fields(reader, data, "a fixed array data block", prefix)
        for i in range(entries):
            found[i] = _defined(reader, values.address())
        return
    pages = -(-entries // page)
    bitmap_size = -(-pages // 8)
    data = reader.at(block, prefix + bitmap_size + 4, "a fixed array data block")
    _fixed_block(reader, data, block, name)
    at = block + prefix + bitmap_size + 4
    for p in range(pages):
        reader.step()
        count = min(page, entries - p * page)
        if data[prefix + p // 8] & (0x80 >> (p % 8)):
            content = reader.at(at, count * o + 4, "a fixed array page")
            reader.check(content, "the fixed array page", at)
            values = Fields(reader, content, "a fixed array page")
            for i in range(count):
                found[p * page + i] = _defined(reader, values.address())
        at += count * o + 4


def _fixed_block(reader: Reader, data: bytes, block: int, name: str) -> None:
    if data[:4] != b"FADB" or data[4] != 0:
        raise BadStructure(reader.path, f"no fixed array data block (FADB, version 0) at address {block}", name)
    reader.check(data, "the fixed array data block", block)


def _defined(reader: Reader, address: int) -> int | None:
    return None if address == reader.undefined else address


def _extensible(
    reader: Reader,
    address: int,
    chunk: tuple[int, ...],
    grid: tuple[int, ...],
    maxshape: tuple[int, ...],
    found: list[int | None],
    name: str,
) -> None:
    """Chunks in an extensible array, element ``i`` the chunk whose grid position, its unlimited dimension moved
    first, is ``i`` in C order over the grid of the maximum shape (libhdf5's swizzled index)."""
    from .earray import ExtensibleArray

    unlimited = [d for d, size in enumerate(maxshape) if size >= UNLIMITED >> (64 - 8 * reader.length_size)]
    if len(unlimited) != 1 or len(maxshape) != len(grid):
        raise BadStructure(reader.path, "an extensible array index for other than one unlimited dimension", name)
    order = [unlimited[0], *(d for d in range(len(grid)) if d != unlimited[0])]
    counts = [-(-maxshape[d] // chunk[d]) for d in order]
    array = ExtensibleArray(reader, address, name)
    for cell, position in enumerate(itertools.product(*(range(g) for g in grid))):
        index = 0
        for d, count in zip(order, counts, strict=True):
            index = index * count + position[d]
        found[cell] = array.get(index)


def _btree_v2(reader: Reader, address: int, grid: tuple[int, ...], found: list[int | None]) -> None:
    for record in v2_records(reader, address, 10):
        fields = Fields(reader, record, "a chunk's B-tree record")
        chunk = fields.address()
        scaled = tuple(fields.u64() for _ in grid)
        _place(reader, found, _cell(reader, scaled, grid, ""), chunk, "")
