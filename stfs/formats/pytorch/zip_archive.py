"""The zip layout (torch >= 1.6): stored entries under one top folder — ``data.pkl``, ``byteorder``, one
``data/KEY`` per storage. Only the end records, the central directory, ``data.pkl``, ``byteorder`` and the local
headers of the storages that reachable tensors use are read; never a storage's bytes."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ... import errors
from .allowed import TORCH_DTYPES, WEIGHTS_ONLY_GLOBALS
from .checkpoint import Checkpoint, StorageBytes, make_checkpoint, used_storages
from .naming import Walker, model_leaves
from .reads import Read, ReadMany, read_exact, read_ranges
from .unpickler import WINDOW, Interpreter, Stream

MAX_ZIP_ENTRIES = 1_000_000
MAX_DIRECTORY = 256 << 20  # bytes of the zip's central directory
TAIL_READ = 22 + 20 + 56  # the first read of a zip, from its end: the end record, ZIP64 locator and record
HEADER_SLACK = 256  # bytes past a local header's name read at once for its extra field (torch's is <= 87)


@dataclass(frozen=True, slots=True)
class _Entry:
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


def _zip_directory(read: Read, size: int, path: str) -> tuple[list[_Entry], int]:
    """The central directory's entries and its offset, read from the end of the file: never an entry's data."""
    fail = errors.InvalidZipArchive
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
    if count > MAX_ZIP_ENTRIES or count * _CENTRAL.size > cd_size or cd_size > MAX_DIRECTORY:
        raise fail(
            path,
            f"{count} entries in a {cd_size}-byte central directory "
            f"(at most {MAX_ZIP_ENTRIES:,} entries and {MAX_DIRECTORY:,} bytes)",
        )
    tail_start = size - tail_size
    if cd_offset >= tail_start:  # read already, with the end records
        directory = tail[cd_offset - tail_start : cd_offset - tail_start + cd_size]
    else:
        directory = read_exact(read, cd_offset, cd_size, path)
    entries: list[_Entry] = []
    pos = 0
    for _ in range(count):
        if pos + _CENTRAL.size > len(directory):
            raise fail(path, "the central directory ends inside an entry")
        fields = _CENTRAL.unpack_from(directory, pos)
        signature, flags, method = fields[0], fields[5], fields[6]
        compressed, usize, name_len, extra_len, comment_len, disk_start = (*fields[10:14], fields[14], fields[15])
        external, header_offset = fields[17], fields[18]
        if signature != b"PK\x01\x02":
            raise fail(path, f"a central directory entry without its signature at byte {cd_offset + pos}")
        pos += _CENTRAL.size
        end = pos + name_len + extra_len + comment_len
        if end > len(directory):
            raise fail(path, "the central directory ends inside an entry's name or extra field")
        raw_name = directory[pos : pos + name_len]
        extra = directory[pos + name_len : pos + name_len + extra_len]
        pos = end
        if 0xFFFFFFFF in (usize, compressed, header_offset) or disk_start == 0xFFFF:
            usize, compressed, header_offset = _zip64_extra(extra, usize, compressed, header_offset, path)
        name = raw_name.decode("utf-8" if flags & 0x800 else "cp437", "replace")
        entries.append(_Entry(name, raw_name, method, flags, compressed, usize, header_offset, external))
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
    raise errors.InvalidZipArchive(path, "an entry's ZIP64 sizes are missing from its extra field")


def _zip_layout(entries: list[_Entry], path: str) -> tuple[str, dict[str, _Entry]]:
    """The top folder and the entries by their name inside it; refusals for anything else in the archive."""
    if not entries:
        raise errors.NotACheckpoint(path, "an empty zip archive")
    top = entries[0].name.split("/", 1)[0]
    inside: dict[str, _Entry] = {}
    for entry in entries:
        head, slash, rest = entry.name.partition("/")
        if head != top or not slash or ".." in rest.split("/") or not top:
            raise errors.EntryOutsideArchive(path, f"entry {entry.name!r} is outside the top folder {top + '/'!r}")
        if not rest or rest.endswith("/"):  # a folder entry: torch writes none, other zip writers do
            continue
        if rest in inside:
            raise errors.InvalidZipArchive(path, f"entry {entry.name!r} appears twice")
        inside[rest] = entry
    if "constants.pkl" in inside or any(name.startswith("code/") for name in inside):
        raise errors.TorchScriptArchive(path, "a TorchScript archive (torch.jit.save): code, not a checkpoint")
    if "data.pkl" not in inside:
        raise errors.NotACheckpoint(path, f"a zip archive without {top}/data.pkl")
    return top, inside


def _local_headers(
    read: Read,
    many: ReadMany,
    entries: Sequence[_Entry],
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
            raise errors.InvalidZipArchive(path, f"entry {entry.name!r}: its local header lies past the entries")
        length = fixed + (HEADER_SLACK + wanted if wanted else 0)
        ranges.append((entry.header_offset, max(fixed, min(length, bound - entry.header_offset))))
    blocks = read_ranges(many, ranges, path)
    out = []
    for entry, wanted, block in zip(entries, want, blocks, strict=True):
        signature, _, _, _, method, _, _, _, _, _, name_len, extra_len = _LOCAL.unpack_from(block)
        if signature != b"PK\x03\x04":
            raise errors.InvalidZipArchive(path, f"entry {entry.name!r}: no local header at byte {entry.header_offset}")
        if block[_LOCAL.size : _LOCAL.size + name_len] != entry.raw_name or method != entry.method:
            raise errors.InvalidZipArchive(path, f"entry {entry.name!r}: its local header names another entry")
        inner = _LOCAL.size + name_len + extra_len
        start = entry.header_offset + inner
        if start + entry.compressed > cd_start:
            raise errors.InvalidZipArchive(
                path, f"entry {entry.name!r}: its data ({start}+{entry.compressed}) runs into the central directory"
            )
        data = block[inner : inner + wanted]
        if len(data) < wanted:
            data = read_exact(read, start, wanted, path)
        out.append((start, data))
    return out


def _next_headers(wanted: Sequence[_Entry], entries: Sequence[_Entry], cd_start: int) -> list[int]:
    """For each wanted entry, where the next entry's local header (or the central directory) begins."""
    starts = sorted({e.header_offset for e in entries} | {cd_start})
    return [next((s for s in starts if s > entry.header_offset), entry.header_offset) for entry in wanted]


def _stored(entry: _Entry, path: str) -> None:
    if entry.external & 0x10:  # torch's reader (miniz) takes it for a folder and reads none of its bytes
        raise errors.InvalidZipArchive(path, f"entry {entry.name!r} is marked a directory (its external attributes)")
    if entry.flags & 0x1:
        raise errors.CompressedEntry(path, f"entry {entry.name!r} is encrypted")
    if entry.method != 0 or entry.compressed != entry.size:
        raise errors.CompressedEntry(
            path, f"entry {entry.name!r} is compressed (method {entry.method}); torch.save stores every entry"
        )


@dataclass(frozen=True, slots=True)
class _Unpickled:
    """A zip checkpoint's pickle, interpreted: its top object, and what placing its storages needs."""

    interpreter: Interpreter
    top_object: Any
    entries: list[_Entry]
    cd_start: int
    top: str
    inside: dict[str, _Entry]
    pickle_range: tuple[int, int]


def zip_object(read: Read, many: ReadMany, size: int, path: str) -> tuple[Any, tuple[str, ...]]:
    """The top object of the zip checkpoint behind ``read`` as plain values (``values``), and the globals its pickle
    names that ``torch.load(weights_only=True)`` refuses: a pickled object that is not tensors (a DCP's bytes entry,
    a step counter), read as a checkpoint's pickle is, never run."""
    unpickled = _unpickle(read, many, size, path)
    names = unpickled.interpreter.globals
    return unpickled.top_object, tuple(name for name in names if name not in WEIGHTS_ONLY_GLOBALS)


def _unpickle(read: Read, many: ReadMany, size: int, path: str) -> _Unpickled:
    entries, cd_start = _zip_directory(read, size, path)
    top, inside = _zip_layout(entries, path)
    wanted = [inside["data.pkl"]] + ([inside["byteorder"]] if "byteorder" in inside else [])
    for entry in wanted:
        _stored(entry, path)
    # data.pkl and byteorder (written right after it) with their local headers: one read where they fit.
    (pickle_start, first), *order = _local_headers(
        read,
        many,
        wanted,
        [min(e.size, WINDOW) for e in wanted],
        _next_headers(wanted, entries, cd_start),
        cd_start,
        path,
    )
    if order and order[0][1] != b"little":
        raise errors.BigEndianCheckpoint(
            path, f"its byteorder record says {order[0][1][:16]!r}: stfs reads little-endian checkpoints only"
        )
    pickle_size = wanted[0].size
    interpreter = Interpreter(path)
    top_object = interpreter.run(Stream(read, path, pickle_start, pickle_start + pickle_size, WINDOW, first))
    return _Unpickled(interpreter, top_object, entries, cd_start, top, inside, (pickle_start, pickle_size))


def read_zip(read: Read, many: ReadMany, size: int, path: str) -> Checkpoint:
    unpickled = _unpickle(read, many, size, path)
    cd_start, top, inside = unpickled.cd_start, unpickled.top, unpickled.inside
    leaves, model_key = model_leaves(unpickled.top_object, Walker(path))
    data_entries = []
    for key, ref in used_storages(leaves).items():
        found_entry = inside.get(f"data/{key}")
        if found_entry is None:
            raise errors.InvalidStorage(path, f"storage {key!r} has no entry {top}/data/{key}")
        entry = found_entry
        _stored(entry, path)
        itemsize = TORCH_DTYPES[ref.dtype][1] if ref.dtype is not None else 1
        if ref.numel * itemsize != entry.size:
            raise errors.InvalidStorage(
                path,
                f"storage {key!r} holds {ref.numel} x {ref.dtype} in the pickle, {entry.size} bytes in {entry.name}",
            )
        data_entries.append((key, entry))
    storage_entries = [entry for _, entry in data_entries]
    zeros = [0] * len(storage_entries)
    found = _local_headers(read, many, storage_entries, zeros, [cd_start] * len(zeros), cd_start, path)
    storages = {
        key: StorageBytes(start, entry.size) for (key, entry), (start, _) in zip(data_entries, found, strict=True)
    }
    return make_checkpoint(
        path=path,
        layout="zip",
        size=size,
        interpreter=unpickled.interpreter,
        leaves=leaves,
        model_key=model_key,
        storages=storages,
        pickle_range=unpickled.pickle_range,
        archive_name=top,
    )
