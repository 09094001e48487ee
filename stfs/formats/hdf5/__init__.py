"""HDF5 weights (SPEC §17): Keras' ``.weights.h5`` and ``.h5`` (Keras 2, TensorFlow's ``tf_model.h5``), any ``.h5``/
``.hdf5`` h5py wrote, and Keras 3's ``.keras`` (a zip of stored members holding ``model.weights.h5``).

Read from the HDF Group's file format specification, without libhdf5 or h5py (``objects``: superblock and object
headers; ``messages``; ``walk``: groups; ``heaps``, ``btrees``; ``datasets``: a dataset as a tensor; ``chunks``;
``attributes``; ``keras``: the zip). Every dataset of a numeric type is a tensor named by its path of groups joined
with ``.``, its bytes in C order as h5py's ``dataset[()]`` gives them: one range of the file (compact and
contiguous storage) or gathered from its chunks. Attributes of the file and of groups are ``metadata/`` files of
JSON, named by the group's path and the attribute's name. Only metadata is read: the superblock, object headers,
B-trees and heaps, a window at a time, a level of the group tree at once (a remote file's in parallel).
"""

from __future__ import annotations

from ..base import Format, Header, RangeFetcher, made_header
from .datasets import Hdf5Entry
from .file import read_hdf5
from .io import Reader
from .objects import SIGNATURE
from .rules import Hdf5Error

__all__ = ["FORMAT", "Hdf5Entry", "Hdf5Error", "fetch_header"]

KERAS_MEMBERS = ("metadata.json", "config.json", "model.weights.h5")


def fetch_header(fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0) -> Header:
    """Read the HDF5 file (or ``.keras`` zip) ``path`` through ``fetch`` as a ``Header``: tensors at absolute offsets
    (``data_start`` 0), ``header.json`` made in the safetensors schema."""
    head = fetch(0, min(file_size, 512)) if file_size else b""
    if _keras(bytes(head)):
        from .keras import read_keras

        tensors, metadata, warnings = read_keras(fetch, path, file_size)
    else:
        reader = Reader(fetch, path, 0, file_size, first_read)
        tensors, metadata, warnings = read_hdf5(reader)
    return made_header(
        path=path,
        file_size=file_size,
        mtime_ns=mtime_ns,
        tensors=tensors,
        metadata=metadata,
        warnings=tuple(warnings),
    )


def _keras(head: bytes) -> bool:
    """Whether ``head`` begins a ``.keras`` zip (its first member one Keras writes); the zip module is imported only
    for a zip."""
    if not head.startswith(b"PK\x03\x04"):
        return False
    from ..zip import first_member

    return first_member(head) in KERAS_MEMBERS


def safetensors_name(path: str) -> str:
    """``x.weights.h5``, ``x.h5``, ``x.hdf5``, ``x.keras`` -> ``x.safetensors``; ``tf_model.h5`` ->
    ``model.safetensors`` (``safetensors_names`` gives ``tf_model.safetensors`` after it)."""
    folder, _, name = path.rpartition("/")
    if name == "tf_model.h5":
        name = "model.safetensors"
    else:
        for suffix in (".weights.h5", ".h5", ".hdf5", ".keras"):
            if name.endswith(suffix):
                name = name[: -len(suffix)]
                break
        name += ".safetensors"
    return f"{folder}/{name}" if folder else name


class _Hdf5(Format):
    name = "hdf5"
    title = "HDF5"
    head_size = 2048 + len(SIGNATURE)  # the signature after a user block of up to 2 KiB; a zip's first member

    def sniff(self, head: bytes) -> bool:
        """The superblock's signature at byte 0, 512, 1024 or 2048 (after a user block; a larger one is found by
        the file's name), or a ``.keras`` zip."""
        return any(head[at : at + len(SIGNATURE)] == SIGNATURE for at in (0, 512, 1024, 2048)) or _keras(head)

    def read_header(
        self, fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0
    ) -> Header:
        return fetch_header(fetch, path=path, file_size=file_size, mtime_ns=mtime_ns, first_read=first_read)

    def safetensors_name(self, path: str) -> str | None:
        return safetensors_name(path)

    def safetensors_names(self, path: str) -> tuple[str, ...]:
        """``tf_model.h5`` -> ``model.safetensors`` where the folder has none, else ``tf_model.safetensors``."""
        folder, _, name = path.rpartition("/")
        if name != "tf_model.h5":
            return (safetensors_name(path),)
        return tuple(f"{folder}/{each}" if folder else each for each in ("model.safetensors", "tf_model.safetensors"))


FORMAT: Format = _Hdf5()
