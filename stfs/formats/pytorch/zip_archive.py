"""The zip layout (torch >= 1.6): stored entries under one top folder — ``data.pkl``, ``byteorder``, one
``data/KEY`` per storage. Only the end records, the central directory, ``data.pkl``, ``byteorder`` and the local
headers of the storages that reachable tensors use are read (``formats.zip``); never a storage's bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ... import errors
from ..base import RangeFetcher as Read
from ..base import ReadMany
from ..zip import Entry, EntryNotStored, Words, ZipError, check_stored, directory, local_headers, next_headers, reworded
from .allowed import TORCH_DTYPES, WEIGHTS_ONLY_GLOBALS
from .checkpoint import Checkpoint, StorageBytes, make_checkpoint, used_storages
from .naming import Walker, model_leaves
from .rules import (
    BigEndianCheckpoint,
    CheckpointTruncated,
    CompressedEntry,
    EntryOutsideArchive,
    InvalidStorage,
    InvalidZipArchive,
    NotACheckpoint,
    TorchScriptArchive,
)
from .unpickler import WINDOW, Interpreter, Stream

# The shared readers' refusals (formats.zip, base.read_exact) as a checkpoint's.
WORDS: Words = {
    EntryNotStored: lambda path, detail: CompressedEntry(path, f"{detail}; torch.save stores every entry"),
    ZipError: InvalidZipArchive,
    errors.TruncatedFile: CheckpointTruncated,
}


def _stored(entry: Entry, path: str) -> None:
    check_stored(entry, path)


def _zip_layout(entries: list[Entry], path: str) -> tuple[str, dict[str, Entry]]:
    """The top folder and the entries by their name inside it; refusals for anything else in the archive."""
    if not entries:
        raise NotACheckpoint(path, "an empty zip archive")
    top = entries[0].name.split("/", 1)[0]
    inside: dict[str, Entry] = {}
    for entry in entries:
        head, slash, rest = entry.name.partition("/")
        if head != top or not slash or ".." in rest.split("/") or not top:
            raise EntryOutsideArchive(path, f"entry {entry.name!r} is outside the top folder {top + '/'!r}")
        if not rest or rest.endswith("/"):  # a folder entry: torch writes none, other zip writers do
            continue
        if rest in inside:
            raise InvalidZipArchive(path, f"entry {entry.name!r} appears twice")
        inside[rest] = entry
    if "constants.pkl" in inside or any(name.startswith("code/") for name in inside):
        raise TorchScriptArchive(path, "a TorchScript archive (torch.jit.save): code, not a checkpoint")
    if "data.pkl" not in inside:
        raise NotACheckpoint(path, f"a zip archive without {top}/data.pkl")
    return top, inside


@dataclass(frozen=True, slots=True)
class _Unpickled:
    """A zip checkpoint's pickle, interpreted: its top object, and what placing its storages needs."""

    interpreter: Interpreter
    top_object: Any
    entries: list[Entry]
    cd_start: int
    top: str
    inside: dict[str, Entry]
    pickle_range: tuple[int, int]


def zip_object(read: Read, many: ReadMany, size: int, path: str) -> tuple[Any, tuple[str, ...]]:
    """The top object of the zip checkpoint behind ``read`` as plain values (``values``), and the globals its pickle
    names that ``torch.load(weights_only=True)`` refuses: a pickled object that is not tensors (a DCP's bytes entry,
    a step counter), read as a checkpoint's pickle is, never run."""
    with reworded(path, WORDS):
        unpickled = _unpickle(read, many, size, path)
    names = unpickled.interpreter.globals
    return unpickled.top_object, tuple(name for name in names if name not in WEIGHTS_ONLY_GLOBALS)


def _unpickle(read: Read, many: ReadMany, size: int, path: str) -> _Unpickled:
    entries, cd_start = directory(read, size, path)
    top, inside = _zip_layout(entries, path)
    wanted = [inside["data.pkl"]] + ([inside["byteorder"]] if "byteorder" in inside else [])
    for entry in wanted:
        _stored(entry, path)
    # data.pkl and byteorder (written right after it) with their local headers: one read where they fit.
    (pickle_start, first), *order = local_headers(
        read,
        many,
        wanted,
        [min(e.size, WINDOW) for e in wanted],
        next_headers(wanted, entries, cd_start),
        cd_start,
        path,
    )
    if order and order[0][1] != b"little":
        raise BigEndianCheckpoint(
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
            raise InvalidStorage(path, f"storage {key!r} has no entry {top}/data/{key}")
        entry = found_entry
        _stored(entry, path)
        itemsize = TORCH_DTYPES[ref.dtype][1] if ref.dtype is not None else 1
        if ref.numel * itemsize != entry.size:
            raise InvalidStorage(
                path,
                f"storage {key!r} holds {ref.numel} x {ref.dtype} in the pickle, {entry.size} bytes in {entry.name}",
            )
        data_entries.append((key, entry))
    storage_entries = [entry for _, entry in data_entries]
    zeros = [0] * len(storage_entries)
    found = local_headers(read, many, storage_entries, zeros, [cd_start] * len(zeros), cd_start, path)
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
        top_object=unpickled.top_object,
    )
