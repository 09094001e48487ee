"""How the HDF5 reader reads: a file's metadata (superblock, object headers, B-trees, heaps) by range through the
format seam's fetch, kept in windows so that a remote file costs few requests, and bounded whatever the file says
(``Reader``); addresses relative to the superblock, sizes of its offsets and lengths; Jenkins' lookup3 checksum of
the version 2 structures."""

from __future__ import annotations

import bisect
import struct
from collections.abc import Sequence
from typing import Any

from ..base import RangeFetcher, ReadMany
from .rules import BadStructure, Hdf5Truncated, TooLarge

WINDOW = 2048  # bytes read at least at a miss of a remote file: an object header and what h5py allocates beside it
LOCAL_WINDOW = 4096  # of a local file (a first read of a few bytes says reads are cheap), no prefetch
CHEAP_FIRST_READ = 4096  # a source whose first read is smaller reads cheaply (a local file's: 8 bytes)
BEHIND = 2  # a local window's share before the byte missed: 1/BEHIND
COALESCE = 256  # windows of a prefetch closer than this are read as one
MAX_METADATA = 256 << 20  # metadata bytes one header may read in all
MAX_STEPS = 2_000_000  # objects, nodes, messages and records one header may walk


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & 0xFFFFFFFF


def lookup3(data: bytes) -> int:
    """Bob Jenkins' lookup3 ``hashlittle`` of ``data`` with initial value 0: the checksum of HDF5's version 2
    structures (the specification's "Jenkins' lookup3")."""
    length = len(data)
    a = b = c = (0xDEADBEEF + length) & 0xFFFFFFFF
    if length == 0:
        return c
    tail = length - ((length - 1) // 12) * 12  # the last block holds 1 to 12 bytes
    padded = data + bytes(12 - tail)
    words = struct.unpack(f"<{len(padded) // 4}I", padded)
    m = 0xFFFFFFFF
    for i in range(0, len(words) - 3, 3):
        a = (a + words[i]) & m
        b = (b + words[i + 1]) & m
        c = (c + words[i + 2]) & m
        a = ((a - c) & m) ^ _rot(c, 4)
        c = (c + b) & m
        b = ((b - a) & m) ^ _rot(a, 6)
        a = (a + c) & m
        c = ((c - b) & m) ^ _rot(b, 8)
        b = (b + a) & m
        a = ((a - c) & m) ^ _rot(c, 16)
        c = (c + b) & m
        b = ((b - a) & m) ^ _rot(a, 19)
        a = (a + c) & m
        c = ((c - b) & m) ^ _rot(b, 4)
        b = (b + a) & m
    a = (a + words[-3]) & m
    b = (b + words[-2]) & m
    c = (c + words[-1]) & m
    c = (c ^ b) - _rot(b, 14) & m
    a = (a ^ c) - _rot(c, 11) & m
    b = (b ^ a) - _rot(a, 25) & m
    c = (c ^ b) - _rot(b, 16) & m
    a = (a ^ c) - _rot(c, 4) & m
    b = (b ^ a) - _rot(a, 14) & m
    c = (c ^ b) - _rot(b, 24) & m
    return c


class Reader:
    """The bytes of one HDF5 file (or of a ``.keras`` zip's stored member): ``start`` its first byte in the file
    ``fetch`` reads, ``size`` its length; ``base`` the superblock's position in it, from which every address counts
    (set once the superblock is found). ``offset_size``/``length_size``: the superblock's sizes of offsets and
    lengths. Reads are kept in windows; ``step`` counts the walk's work against ``MAX_STEPS``."""

    def __init__(self, fetch: RangeFetcher, path: str, start: int, size: int, first_read: int = 0) -> None:
        self.fetch = fetch
        self.path = path
        self.start = start
        self.size = size
        self.base = 0
        self.offset_size = 8
        self.length_size = 8
        self.undefined = (1 << 64) - 1
        self._starts: list[int] = []  # sorted window starts (relative to ``start``)
        self._windows: dict[int, tuple[int, int, bytes]] = {}  # by start: (start, end, bytes)
        self._read = 0
        self._steps = 0
        self._last: tuple[int, int, bytes] = (0, 0, b"")  # the window the last read found: most reads follow it
        self.memo: dict[tuple[int, bytes], Any] = {}  # messages decoded, by kind and bytes: datasets share them
        cheap = first_read < CHEAP_FIRST_READ
        self.window = LOCAL_WINDOW if cheap else WINDOW
        self._many: ReadMany | None = None if cheap else getattr(fetch, "many", None)
        if first_read:
            self._fill(0, min(first_read, size))

    @property
    def batches(self) -> bool:
        """Whether reads are asked for in batches (``prefetch``): a remote file's."""
        return self._many is not None

    def set_sizes(self, base: int, offset_size: int, length_size: int) -> None:
        self.base = base
        self.offset_size = offset_size
        self.length_size = length_size
        self.undefined = (1 << (8 * offset_size)) - 1

    def step(self, count: int = 1) -> None:
        self._steps += count
        if self._steps > MAX_STEPS:
            raise TooLarge(self.path, f"its structures take more than {MAX_STEPS:,} steps to walk")

    @property
    def steps_left(self) -> int:
        """Steps the walk may still take before ``step`` refuses the file."""
        return MAX_STEPS - self._steps

    def absolute(self, address: int) -> int:
        """The byte of the file ``fetch`` reads where ``address`` (relative to the superblock) lies."""
        return self.start + self.base + address

    def at(self, address: int, size: int, what: str) -> bytes:
        """``size`` bytes at ``address``; ``Hdf5Truncated`` naming ``what`` where they are not all in the file."""
        offset = self.base + address
        first, end, window = self._last
        if first <= offset and offset + size <= end and size >= 0:  # raw's first case, without its call
            return window[offset - first : offset - first + size]
        return self.raw(offset, size, what)

    def upto(self, address: int, size: int, what: str, least: int) -> bytes:
        """At least ``least`` bytes at ``address``, and up to ``size`` where the window read for them holds more: a
        structure whose length its first bytes tell, taken in one go where it is short (never a read for more)."""
        offset = self.base + address
        first, end, window = self._last
        if first <= offset and offset + least <= end:  # window_for's first case, without its call
            return window[offset - first : offset - first + size]
        first, window = self.window_for(address, least, what)
        return window[offset - first : offset - first + size]

    def raw(self, offset: int, size: int, what: str) -> bytes:
        """``size`` bytes at ``offset`` from the start of the HDF5 file (before its superblock too)."""
        first, end, window = self._last
        if first <= offset and offset + size <= end and size >= 0:
            return window[offset - first : offset - first + size]
        if offset < 0 or size < 0 or offset + size > self.size:
            raise Hdf5Truncated(
                self.path, f"{what} at byte {offset} ({size} bytes) lies past the end of the file ({self.size} bytes)"
            )
        i = bisect.bisect_right(self._starts, offset) - 1
        if i >= 0:
            found = self._windows[self._starts[i]]
            first, end, window = found
            if offset + size <= end:
                self._last = found
                return window[offset - first : offset - first + size]
        return self._fill(offset, size)[:size]

    def window_for(self, address: int, least: int, what: str) -> tuple[int, bytes]:
        """The window held (or read now) that has ``least`` bytes at ``address``: where it starts, from the start of
        the HDF5 file as ``raw`` counts, and its bytes (``upto`` takes its bytes from it, and so do the C loops)."""
        offset = self.base + address
        first, end, window = self._last
        if first <= offset and offset + least <= end:
            return first, window
        i = bisect.bisect_right(self._starts, offset) - 1
        if i >= 0:
            found = self._windows[self._starts[i]]
            first, end, window = found
            if offset + least <= end and least >= 0:
                self._last = found
                return first, window
        self.raw(offset, least, what)  # the window that holds them is now the last one found
        first, end, window = self._last
        if first <= offset and offset + least <= end:
            return first, window
        return offset, self.raw(offset, least, what)

    def _fill(self, offset: int, size: int) -> bytes:
        wanted = offset
        if self._many is None:  # a local window starts before too: libhdf5 puts a group's heap before its header
            offset = max(0, offset - self.window // BEHIND)
        length = min(max(size + wanted - offset, self.window), self.size - offset)
        self._read += length
        if self._read > MAX_METADATA:
            raise TooLarge(self.path, f"its metadata is more than {MAX_METADATA >> 20} MiB")
        data = bytes(self.fetch(self.start + offset, length))
        if len(data) < size + wanted - offset:
            raise Hdf5Truncated(self.path, f"the file ends at byte {offset + len(data)}, inside bytes {wanted}+{size}")
        self._keep(offset, data)
        self._last = (offset, offset + len(data), data)
        return data[wanted - offset :]

    def _keep(self, offset: int, data: bytes) -> None:
        held = self._windows.get(offset)
        if held is None:
            bisect.insort(self._starts, offset)
        if held is None or len(data) >= len(held[2]):
            self._windows[offset] = (offset, offset + len(data), data)

    def prefetch(self, addresses: Sequence[int], size: int = WINDOW) -> None:
        """Read the windows at ``addresses`` not held yet, all at once where ``fetch`` reads ranges together (a
        remote file's in parallel): the next level of a walk."""
        if self._many is None:
            return
        wanted: list[tuple[int, int]] = []
        for address in sorted(set(addresses)):
            offset = self.base + address
            if not 0 <= offset < self.size or self._held(offset, min(size, self.size - offset)):
                continue
            length = min(size, self.size - offset)
            if wanted and offset <= sum(wanted[-1]) + COALESCE:  # close to the one before: one read of both
                first = wanted[-1][0]
                wanted[-1] = (first, max(sum(wanted[-1]), offset + length) - first)
                continue
            wanted.append((offset, length))
        if not wanted:
            return
        self._read += sum(length for _, length in wanted)
        if self._read > MAX_METADATA:
            raise TooLarge(self.path, f"its metadata is more than {MAX_METADATA >> 20} MiB")
        for (offset, _), data in zip(wanted, self._many([(self.start + o, n) for o, n in wanted]), strict=True):
            self._keep(offset, bytes(data))

    def _held(self, offset: int, size: int) -> bool:
        i = bisect.bisect_right(self._starts, offset) - 1
        return i >= 0 and offset + size <= self._windows[self._starts[i]][1]

    def check(self, data: bytes, what: str, address: int) -> None:
        """Refuse a version 2 structure whose last 4 bytes are not the lookup3 checksum of the bytes before."""
        stored = struct.unpack_from("<I", data, len(data) - 4)[0]
        if lookup3(data[:-4]) != stored:
            raise BadStructure(self.path, f"the checksum of {what} at address {address} does not match its bytes")


class Fields:
    """A cursor over a structure's bytes: unsigned little-endian fields, addresses and lengths of the superblock's
    sizes; ``BadStructure`` naming ``what`` where the bytes end first."""

    __slots__ = ("data", "length_size", "offset_size", "pos", "reader", "what")

    def __init__(self, reader: Reader, data: bytes, what: str, pos: int = 0) -> None:
        self.reader = reader
        self.offset_size = reader.offset_size
        self.length_size = reader.length_size
        self.data = data
        self.what = what
        self.pos = pos

    def take(self, size: int) -> bytes:
        if size < 0 or self.pos + size > len(self.data):
            raise BadStructure(self.reader.path, f"{self.what} ends inside a field at byte {self.pos}")
        out = self.data[self.pos : self.pos + size]
        self.pos += size
        return out

    def uint(self, size: int) -> int:
        pos = self.pos
        end = pos + size
        if end > len(self.data):
            raise BadStructure(self.reader.path, f"{self.what} ends inside a field at byte {pos}")
        self.pos = end
        return int.from_bytes(self.data[pos:end], "little")

    def u8(self) -> int:
        return self.uint(1)

    def u16(self) -> int:
        return self.uint(2)

    def u32(self) -> int:
        return self.uint(4)

    def u64(self) -> int:
        return self.uint(8)

    def address(self) -> int:
        return self.uint(self.offset_size)

    def length(self) -> int:
        return self.uint(self.length_size)

    def skip(self, size: int) -> None:
        self.take(size)

    @property
    def left(self) -> int:
        return len(self.data) - self.pos
