"""``gguf-split`` sets: the names of a set's splits, and a set checked as llama.cpp's model loader does and merged."""

from __future__ import annotations

import re
from collections.abc import Sequence

from .rules import DuplicateSplitTensor, MissingSplit, SplitOutOfPlace, SplitTensorCount
from .types import _VALUE_TYPE_NAMES, GgufHeader, GgufSplitSet, GgufTensor, GGUFValueType, KeyValue

# -- split sets (gguf-split) -------------------------------------------------------------------------------------

SPLIT_NO = "split.no"
SPLIT_COUNT = "split.count"
SPLIT_TENSORS_COUNT = "split.tensors.count"
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_set_names(file_name: str) -> tuple[str, list[str]] | None:
    """For a split's file name (``x-00002-of-00003.gguf``), the set's name and every split's name in order;
    ``None`` for a name that is not a split's (``gguf-split`` counts from 1)."""
    match = _SPLIT_NAME.match(file_name)
    if match is None:
        return None
    no, count = int(match["no"]), int(match["count"])
    if not 1 <= no <= count:
        return None
    prefix = match["prefix"]
    return prefix, [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def merge_splits(name: str, files: Sequence[str], headers: Sequence[GgufHeader | None]) -> GgufSplitSet:
    """Check a split set as llama.cpp's model loader does and merge it; ``headers[i]`` is ``None`` where split
    ``files[i]`` is absent. Every split present, each ``split.no`` its place (and split 0's ``split.count`` the
    number of splits), tensor names unique across splits, their number ``split.tensors.count``."""
    if len(files) != len(headers):
        raise ValueError("one header per split file")
    for file, header in zip(files, headers, strict=True):
        if header is None:
            raise MissingSplit(f"{file}: split of {name!r} is missing ({len(files)} splits)")
    present = [h for h in headers if h is not None]
    for index, header in enumerate(present):
        number = _split_key(header, SPLIT_NO, GGUFValueType.UINT16)
        if number != index:
            raise SplitOutOfPlace(f"{header.path}: {SPLIT_NO} is {number}, but it is split {index} of {name!r}")
    first = present[0]
    count = _split_key(first, SPLIT_COUNT, GGUFValueType.UINT16)
    if count != len(files):
        raise SplitOutOfPlace(f"{first.path}: {SPLIT_COUNT} is {count}, but {name!r} has {len(files)} splits")
    expected = _split_key(first, SPLIT_TENSORS_COUNT, GGUFValueType.INT32)
    owner: dict[str, str] = {}
    tensors: list[tuple[str, GgufTensor]] = []
    metadata: dict[str, KeyValue] = {}
    for file, header in zip(files, present, strict=True):
        for tensor in header.tensors:
            if tensor.name in owner:
                raise DuplicateSplitTensor(
                    f"{header.path}: tensor {tensor.name!r} is also in split {owner[tensor.name]}"
                )
            owner[tensor.name] = file
            tensors.append((file, tensor))
        for key, kv in header.metadata.items():
            metadata.setdefault(key, kv)
    if len(tensors) != expected:
        raise SplitTensorCount(
            f"{first.path}: {SPLIT_TENSORS_COUNT} is {expected}, "
            f"but the {len(files)} splits hold {len(tensors)} tensors"
        )
    return GgufSplitSet(name, tuple(files), tuple(present), tuple(tensors), metadata)


def _split_key(header: GgufHeader, key: str, kind: int) -> int:
    kv = header.metadata.get(key)
    if kv is None:
        raise SplitOutOfPlace(f"{header.path}: key {key!r} of a split is missing")
    if kv.type != kind:
        raise SplitOutOfPlace(f"{header.path}: key {key!r} is of type {kv.type_name}, not {_VALUE_TYPE_NAMES[kind]}")
    assert isinstance(kv.value, int)
    return kv.value
