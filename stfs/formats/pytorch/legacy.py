"""The layout before the zip (``torch.save(..., _use_new_zipfile_serialization=False)``): five pickles (magic
number, protocol, sys_info, the object, the storage keys), then each storage, in the order of the keys, as an int64
element count and its bytes; every storage's offset follows from the pickles (the counts are checked)."""

from __future__ import annotations

import struct

from ..base import RangeFetcher as Read
from ..base import ReadMany, read_ranges
from .allowed import TORCH_DTYPES
from .checkpoint import Checkpoint, StorageBytes, make_checkpoint
from .naming import Walker, model_leaves
from .rules import BigEndianCheckpoint, CheckpointTruncated, InvalidPickle, InvalidStorage, NotACheckpoint
from .unpickler import Interpreter, Stream
from .values import describe

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
# A legacy file starts with a pickle of the magic number: PROTO 2 to 5, a FRAME (protocols 4 and 5), then
# LONG1 of 10 bytes holding it.
LEGACY_MAGIC_LONG = b"\x8a\x0a" + LEGACY_MAGIC.to_bytes(10, "little")
LEGACY_FIRST_READ = 64 << 10


def read_legacy(read: Read, many: ReadMany, size: int, path: str, head: bytes) -> Checkpoint:
    interpreter = Interpreter(path)
    stream = Stream(read, path, 0, size, LEGACY_FIRST_READ, head)
    magic = interpreter.run(stream)
    if magic != LEGACY_MAGIC:
        raise NotACheckpoint(path, "the first pickle is not torch's magic number")
    protocol = interpreter.run(stream)
    if protocol != LEGACY_PROTOCOL:
        raise NotACheckpoint(path, f"legacy protocol version {describe(protocol)}, not {LEGACY_PROTOCOL}")
    sys_info = interpreter.run(stream)
    if type(sys_info) is dict and sys_info.get("little_endian") is False:
        raise BigEndianCheckpoint(path, "its sys_info says big-endian: stfs reads little-endian checkpoints only")
    pickle_start = stream.base
    top_object = interpreter.run(stream)
    pickle_size = stream.base - pickle_start
    keys = interpreter.run(stream)
    if not isinstance(keys, list) or not all(type(k) is str for k in keys):
        raise InvalidPickle(path, f"the storage keys are {describe(keys)}, not a list of strings")
    # Each storage, in the order of the keys: an int64 element count, then its bytes.
    storages: dict[str, StorageBytes] = {}
    counts: list[tuple[str, int, int]] = []  # key, offset of its count, numel
    offset = stream.base
    for key in keys:
        ref = interpreter.storages.get(key)
        if ref is None:
            raise InvalidStorage(path, f"storage {key!r} is in the list of keys but no tensor names it")
        if key in storages:
            raise InvalidStorage(path, f"storage {key!r} is listed twice")
        if ref.dtype is None:
            raise InvalidStorage(path, f"storage {key!r} is of a class stfs does not know: its size is unknown")
        nbytes = ref.numel * TORCH_DTYPES[ref.dtype][1]
        counts.append((key, offset, ref.numel))
        storages[key] = StorageBytes(offset + 8, nbytes)
        offset += 8 + nbytes
    if offset > size:
        raise CheckpointTruncated(path, f"its storages end at byte {offset}, past the end of the {size}-byte file")
    for key in interpreter.storages:
        if key not in storages:
            raise InvalidStorage(path, f"storage {key!r} is named by a tensor but not in the list of keys")
    for (key, at, numel), raw in zip(counts, read_ranges(many, [(at, 8) for _, at, _ in counts], path), strict=True):
        (count,) = struct.unpack("<q", raw)
        if count != numel:
            raise InvalidStorage(path, f"storage {key!r}: {count} elements at byte {at}, {numel} in the pickle")
    leaves, model_key = model_leaves(top_object, Walker(path))
    return make_checkpoint(
        path=path,
        layout="legacy",
        size=size,
        interpreter=interpreter,
        leaves=leaves,
        model_key=model_key,
        storages=storages,
        pickle_range=(pickle_start, pickle_size),
        archive_name=None,
        top_object=top_object,
    )
