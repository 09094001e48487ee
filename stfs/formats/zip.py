"""Zip archives, read by range without reading an entry's data: the end records (ZIP64 too), the central directory,
and local headers, as a format whose files are zips of stored entries (a torch.save checkpoint, NumPy's ``.npz``)
needs them to place each entry's bytes.

Public and neutral: its refusals are ``ZipError`` (the archive's structure) and ``EntryNotStored`` (an entry that is
compressed, encrypted or a folder), and a short file ``errors.TruncatedFile``; the calling format words them as its
own rule errors (``reworded``). ``first_member`` reads the name of the first entry from a file's first bytes, for a
format's ``sniff``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from .. import errors
from .base import RangeFetcher, ReadMany, read_exact, read_ranges


class ZipError(errors.RuleError):
    """The zip structure is broken: end records, central directory, a local header, an entry's sizes."""

    rule_text = "zip archive"
    advice = "unzip -t shows what is wrong with it: fetch it again, or write it again with its writer"


class EntryNotStored(ZipError):
    """An entry whose bytes must be read or served is compressed, encrypted, or marked a folder."""

    rule_text = "stored entries"
    advice = "write it again with its entries stored (zip -0), as its writer does by default"


MAX_ENTRIES = 1_000_000
MAX_DIRECTORY = 256 << 20  # bytes of the zip's central directory
TAIL_READ = 22 + 20 + 56  # the first read of a zip, from its end: the end record, ZIP64 locator and record
HEADER_SLACK = 256  # bytes past a local header's name read at once for its extra field (torch writes <= 87)


@dataclass(frozen=True, slots=True)
class Entry:
    """An entry of the central directory: its ``name`` (decoded as the zip says: UTF-8 or cp437) and ``raw_name``,
    compression ``method`` and ``flags``, sizes, where its local header is, and its external attributes."""

    name: str
    raw_name: bytes
    method: int
    flags: int
    compressed: int
    size: int
    header_offset: int
    external: int = 0  # its external attributes: 0x10, MS-DOS's directory bit, marks a folder


_EOCD = struct.Struct("<4s4H2LH")
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
_LOCAL = struct.Struct("<4s2B4HL2L2H")


def directory(read: RangeFetcher, size: int, path: str) -> tuple[list[Entry], int]:
    """The central directory's entries and its offset, read from the end of the file: never an entry's data."""
    fail = ZipError
    tail_size = min(size, TAIL_READ)
    tail = read_exact(read, size - tail_size, tail_size, path)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 and size > tail_size:  # a comment of up to 64 KiB after the end record
        tail_size = min(size, TAIL_READ + (1 << 16) + _EOCD.size)
        tail = read_exact(read, size - tail_size, tail_size, path)
        at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + _EOCD.size > len(tail):
        raise fail(path, "no end of central directory record")
    eocd_offset = size - tail_size + at
    _, disk, cd_disk, _, count, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, at)
    if eocd_offset + _EOCD.size + comment != size:
        raise fail(path, "the end of central directory record's comment does not end the file")
    end_of_directory = eocd_offset
    locator_offset = eocd_offset - _ZIP64_LOCATOR.size
    if locator_offset >= 0:
        locator = (
            tail[at - _ZIP64_LOCATOR.size : at]
            if at >= _ZIP64_LOCATOR.size
            else read_exact(read, locator_offset, _ZIP64_LOCATOR.size, path)
        )
        signature, _, z64_offset, _ = _ZIP64_LOCATOR.unpack(locator)
        if signature == b"PK\x06\x07":
            if z64_offset + _ZIP64_EOCD.size > locator_offset:
                raise fail(path, f"the ZIP64 end record's offset {z64_offset} is not before its locator")
            tail_start = size - tail_size
            record = (
                tail[z64_offset - tail_start : z64_offset - tail_start + _ZIP64_EOCD.size]
                if z64_offset >= tail_start
                else read_exact(read, z64_offset, _ZIP64_EOCD.size, path)
            )
            (signature, _, _, _, disk, cd_disk, _, count, cd_size, cd_offset) = _ZIP64_EOCD.unpack(record)
            if signature != b"PK\x06\x06":
                raise fail(path, "the ZIP64 locator points at no ZIP64 end record")
            end_of_directory = z64_offset
    if disk != 0 or cd_disk != 0:
        raise fail(path, "a multi-disk archive")
    if cd_offset + cd_size > end_of_directory:
        raise fail(path, f"the central directory ({cd_offset}+{cd_size}) overlaps its end records")
    if count > MAX_ENTRIES or count * _CENTRAL.size > cd_size or cd_size > MAX_DIRECTORY:
        raise fail(
            path,
            f"{count} entries in a {cd_size}-byte central directory "
            f"(at most {MAX_ENTRIES:,} entries and {MAX_DIRECTORY:,} bytes)",
        )
    tail_start = size - tail_size
    if cd_offset >= tail_start:  # read already, with the end records
        listing = tail[cd_offset - tail_start : cd_offset - tail_start + cd_size]
    else:
        listing = read_exact(read, cd_offset, cd_size, path)
    entries: list[Entry] = []
    pos = 0
    for _ in range(count):
        if pos + _CENTRAL.size > len(listing):
            raise fail(path, "the central directory ends inside an entry")
        fields = _CENTRAL.unpack_from(listing, pos)
        signature, flags, method = fields[0], fields[5], fields[6]
        compressed, usize, name_len, extra_len, comment_len, disk_start = (*fields[10:14], fields[14], fields[15])
        external, header_offset = fields[17], fields[18]
        if signature != b"PK\x01\x02":
            raise fail(path, f"a central directory entry without its signature at byte {cd_offset + pos}")
        pos += _CENTRAL.size
        end = pos + name_len + extra_len + comment_len
        if end > len(listing):
            raise fail(path, "the central directory ends inside an entry's name or extra field")
        raw_name = listing[pos : pos + name_len]
        extra = listing[pos + name_len : pos + name_len + extra_len]
        pos = end
        if 0xFFFFFFFF in (usize, compressed, header_offset) or disk_start == 0xFFFF:
            usize, compressed, header_offset = _zip64_extra(extra, usize, compressed, header_offset, path)
        name = raw_name.decode("utf-8" if flags & 0x800 else "cp437", "replace")
        entries.append(Entry(name, raw_name, method, flags, compressed, usize, header_offset, external))
    return entries, cd_offset


def _zip64_extra(extra: bytes, usize: int, compressed: int, offset: int, path: str) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<2H", extra, pos)
        body = extra[pos + 4 : pos + 4 + length]
        pos += 4 + length
        if tag != 1:
            continue
        values = list(struct.unpack_from(f"<{len(body) // 8}Q", body))
        if usize == 0xFFFFFFFF:
            usize = values.pop(0) if values else -1
        if compressed == 0xFFFFFFFF:
            compressed = values.pop(0) if values else -1
        if offset == 0xFFFFFFFF:
            offset = values.pop(0) if values else -1
        if min(usize, compressed, offset) < 0:
            break
        return usize, compressed, offset
    raise ZipError(path, "an entry's ZIP64 sizes are missing from its extra field")


def local_headers(
    read: RangeFetcher,
    many: ReadMany,
    entries: Sequence[Entry],
    want: Sequence[int],
    bounds: Sequence[int],
    cd_start: int,
    path: str,
) -> list[tuple[int, bytes]]:
    """Each entry's absolute data offset (from its local header) and the first ``want`` bytes of its data.

    A header is read as its 30 fixed bytes and name (its extra field's length is all that is needed of the
    rest); where data is wanted too, the read reaches ``HEADER_SLACK`` further for the extra field, but not
    past ``bounds`` (the next entry's header): never into another entry's data. Headers that lie close are
    read together (small storages between them along).
    """
    ranges = []
    for entry, wanted, bound in zip(entries, want, bounds, strict=True):
        fixed = _LOCAL.size + len(entry.raw_name)
        if entry.header_offset + fixed > cd_start:
            raise ZipError(path, f"entry {entry.name!r}: its local header lies past the entries")
        length = fixed + (HEADER_SLACK + wanted if wanted else 0)
        ranges.append((entry.header_offset, max(fixed, min(length, bound - entry.header_offset))))
    blocks = read_ranges(many, ranges, path)
    out = []
    for entry, wanted, block in zip(entries, want, blocks, strict=True):
        signature, _, _, _, method, _, _, _, _, _, name_len, extra_len = _LOCAL.unpack_from(block)
        if signature != b"PK\x03\x04":
            raise ZipError(path, f"entry {entry.name!r}: no local header at byte {entry.header_offset}")
        if block[_LOCAL.size : _LOCAL.size + name_len] != entry.raw_name or method != entry.method:
            raise ZipError(path, f"entry {entry.name!r}: its local header names another entry")
        inner = _LOCAL.size + name_len + extra_len
        start = entry.header_offset + inner
        if start + entry.compressed > cd_start:
            raise ZipError(
                path, f"entry {entry.name!r}: its data ({start}+{entry.compressed}) runs into the central directory"
            )
        data = block[inner : inner + wanted]
        if len(data) < wanted:
            data = read_exact(read, start, wanted, path)
        out.append((start, data))
    return out


def next_headers(wanted: Sequence[Entry], entries: Sequence[Entry], cd_start: int) -> list[int]:
    """For each wanted entry, where the next entry's local header (or the central directory) begins."""
    starts = sorted({e.header_offset for e in entries} | {cd_start})
    return [next((s for s in starts if s > entry.header_offset), entry.header_offset) for entry in wanted]


def check_stored(entry: Entry, path: str) -> None:
    """Refuse an entry whose bytes are not its data as it lies in the archive: compressed, encrypted, a folder."""
    if entry.external & 0x10:  # a reader (miniz, say) takes it for a folder and reads none of its bytes
        raise ZipError(path, f"entry {entry.name!r} is marked a directory (its external attributes)")
    if entry.flags & 0x1:
        raise EntryNotStored(path, f"entry {entry.name!r} is encrypted")
    if entry.method != 0 or entry.compressed != entry.size:
        raise EntryNotStored(path, f"entry {entry.name!r} is compressed (method {entry.method})")


def first_member(head: bytes) -> str | None:
    """The name of the first entry of a zip whose first bytes are ``head`` (its first local header's), or ``None``
    where ``head`` does not begin with a local header whose name it holds whole."""
    if len(head) < _LOCAL.size or head[:4] != b"PK\x03\x04":
        return None
    flags, name_len = _LOCAL.unpack_from(head)[3], _LOCAL.unpack_from(head)[10]
    raw = head[_LOCAL.size : _LOCAL.size + name_len]
    if len(raw) < name_len:
        return None
    return raw.decode("utf-8" if flags & 0x800 else "cp437", "replace")


Words = Mapping[type[errors.RuleError], Callable[[str, str], errors.RuleError]]


@contextmanager
def reworded(path: str, words: Words) -> Iterator[None]:
    """Raise this module's refusals (and ``errors.TruncatedFile``) as the calling format's errors: ``words`` maps each
    class to what makes the format's error from the path and the detail (the most specific class first)."""
    try:
        yield
    except (ZipError, errors.TruncatedFile) as exc:
        for kind, make in words.items():
            if isinstance(exc, kind):
                raise make(path, exc.detail) from None
        raise
