"""One HDF5 file read whole: its superblock, then every object the walk reaches, datasets as tensors and the
attributes of the file and its groups as ``metadata/``."""

from __future__ import annotations

from .attributes import attribute_json
from .datasets import Hdf5Entry, dataset_entry, tensor_name
from .heaps import GlobalHeap
from .io import Reader
from .objects import read_superblock
from .walk import attributes, walk


def read_hdf5(reader: Reader) -> tuple[list[Hdf5Entry], dict[str, str], list[str]]:
    """The tensors, the ``metadata/`` of attributes, and warnings of the HDF5 file ``reader`` reads."""
    superblock = read_superblock(reader)
    heap = GlobalHeap(reader)
    tensors: list[Hdf5Entry] = []
    metadata: dict[str, str] = {}
    warnings: list[str] = []
    for found in walk(reader, superblock.root):
        if found.dataset:
            entry = dataset_entry(reader, heap, found.path, found.messages)
            if entry is None:
                warnings.append(
                    f"{reader.path}: dataset {tensor_name(found.path)!r} is empty (no dataspace): no tensor"
                )
            else:
                tensors.append(entry)
            continue
        for attribute in attributes(reader, found.messages):
            metadata[tensor_name((*found.path, attribute.name))] = attribute_json(reader, heap, attribute)
    return tensors, metadata, warnings
