"""HDF5 files written by h5py and Keras for the tests and the fuzzer, and what h5py reads back from them (the
reference: every dataset's ``dataset[()]`` as C-order little-endian bytes, by stfs's tensor name)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import h5py

os.environ.setdefault("KERAS_BACKEND", "torch")


def tensor_name(path: str) -> str:
    return ".".join(part.replace("%", "%25").replace(".", "%2E") for part in path.strip("/").split("/"))


def h5py_tensors(source: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """h5py's reading of every dataset of ``source``: name -> (numpy dtype, shape, bytes of ``dataset[()]``)."""
    import h5py

    found: dict[str, tuple[str, list[int], bytes]] = {}

    def visit(name: str, item: object) -> None:
        if isinstance(item, h5py.Dataset):
            value = np.asarray(item[()], order="C")
            found[tensor_name(name)] = (str(value.dtype), list(value.shape), value.tobytes())

    with h5py.File(source, "r") as file:
        file.visititems(visit)
    return found


def mixed(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Arrays of every dtype h5py writes as a number, and shapes of every rank up to 4."""
    return {
        "a/f32": rng.standard_normal((5, 7)).astype(np.float32),
        "a/f16": rng.standard_normal(9).astype(np.float16),
        "a/f64": rng.standard_normal((2, 3, 4)).astype(np.float64),
        "b/i8": rng.integers(-100, 100, (3, 3)).astype(np.int8),
        "b/u8": rng.integers(0, 200, 11).astype(np.uint8),
        "b/i16": rng.integers(-1000, 1000, (4, 2)).astype(np.int16),
        "b/u16": rng.integers(0, 1000, 6).astype(np.uint16),
        "b/i32": rng.integers(-(10**6), 10**6, (2, 2, 2, 2)).astype(np.int32),
        "b/u32": rng.integers(0, 10**6, 5).astype(np.uint32),
        "b/i64": rng.integers(-(10**9), 10**9, 4).astype(np.int64),
        "b/u64": rng.integers(0, 10**9, 3).astype(np.uint64),
        "c/bool": rng.integers(0, 2, (3, 5)).astype(bool),
        "c/scalar": np.array(2.5, np.float32),
        "c/empty": np.zeros((0, 4), np.float32),
        "deep/er/still/w": rng.standard_normal((3, 2)).astype(np.float32),
    }


def _created(path: Path, libver: str, userblock: int, istore_k: int) -> h5py.File:
    """A new h5py file; with ``istore_k``, its chunk B-trees' K not libhdf5's default 32, which makes libhdf5 write
    a version 1 superblock (the K is one of its fields)."""
    import h5py

    version = (libver, "latest") if libver != "earliest" else "earliest"
    if not istore_k:
        return h5py.File(path, "w", libver=version, userblock_size=userblock)
    create = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    create.set_userblock(userblock)
    # h5py does not wrap H5Pset_istore_k: called in the libhdf5 h5py itself links (found through its module)
    set_istore_k = ctypes.CDLL(h5py.h5p.__file__).H5Pset_istore_k
    set_istore_k.argtypes, set_istore_k.restype = [ctypes.c_int64, ctypes.c_uint], ctypes.c_int
    assert set_istore_k(create.id, istore_k) >= 0
    access = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    bounds = {"earliest": h5py.h5f.LIBVER_EARLIEST, "latest": h5py.h5f.LIBVER_LATEST}
    access.set_libver_bounds(bounds[libver], h5py.h5f.LIBVER_LATEST)
    return h5py.File(h5py.h5f.create(bytes(path), h5py.h5f.ACC_TRUNC, fapl=access, fcpl=create))


def write_h5py(
    path: Path,
    arrays: dict[str, np.ndarray],
    *,
    libver: str = "earliest",
    userblock: int = 0,
    istore_k: int = 0,
    **options: object,
) -> Path:
    """``arrays`` as datasets of an h5py file (``options``: create_dataset's, ``chunks=...``; ``compact``), with
    attributes on the file and a group; ``userblock`` bytes before the superblock; ``istore_k`` (not 0): the K of
    its chunk B-trees (a version 1 superblock)."""
    import h5py

    with _created(path, libver, userblock, istore_k) as file:
        file.attrs["keras_version"] = b"2.15.0"
        file.attrs["backend"] = "tensorflow"
        file.attrs["numbers"] = np.arange(3, dtype=np.int32)
        compact = options.pop("compact", False)
        for name, array in arrays.items():
            kwargs = dict(options)
            if array.ndim == 0 or array.size == 0:
                kwargs.pop("chunks", None)
            if compact:
                dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                dcpl.set_layout(h5py.h5d.COMPACT)
                kwargs["dcpl"] = dcpl
            file.create_dataset(name, data=array, **kwargs)
        group = file.require_group("a")
        group.attrs["weight_names"] = np.array([b"a/f32", b"a/f16"])
    return path


def write_keras(folder: Path, *, bf16: bool = True) -> tuple[Path, Path, Path]:
    """A small Keras 3 model (a bfloat16 layer where ``bf16``) saved as ``.weights.h5``, ``.keras`` and the legacy
    ``.h5`` of Keras 2 (``model_weights/`` with ``layer_names``, ``model_config`` a variable-length string)."""
    import keras

    def model(bf16: bool) -> keras.Model:
        layers = [
            keras.Input((6,)),
            keras.layers.Dense(5, dtype="bfloat16" if bf16 else "float32", name="first"),
            keras.layers.LayerNormalization(name="norm"),
            keras.layers.Dense(3, name="last"),
        ]
        return keras.Sequential(layers, name="net")

    weights, whole, legacy = folder / "net.weights.h5", folder / "net.keras", folder / "legacy.h5"
    built = model(bf16)
    built.save_weights(weights)
    built.save(whole)
    model(False).save(legacy)  # "considered legacy": what tf_model.h5 files are (its bfloat16 has no dtype attribute)
    return weights, whole, legacy


def many_links(path: Path, count: int, *, libver: str = "latest", track_order: bool = False) -> Path:
    """A group of ``count`` small datasets (dense links in a fractal heap past 8 with libver latest or track_order)."""
    import h5py

    with h5py.File(
        path, "w", libver=(libver, "latest") if libver != "earliest" else "earliest", track_order=track_order
    ) as file:
        group = file.create_group("many", track_order=track_order)
        for i in range(count):
            group.create_dataset(f"w{i:04d}", data=np.full((2, 3), i, np.float32))
            group.attrs[f"attr{i:03d}"] = i
    return path


WRITERS: dict[str, Callable[[Path], Path]] = {
    "earliest": lambda path: write_h5py(path, mixed(np.random.default_rng(1))),
    "latest": lambda path: write_h5py(path, mixed(np.random.default_rng(2)), libver="latest"),
    "compact": lambda path: write_h5py(
        path, {k: v for k, v in mixed(np.random.default_rng(3)).items() if v.size}, compact=True
    ),
    "chunked": lambda path: write_h5py(
        path, {k: v for k, v in mixed(np.random.default_rng(4)).items() if v.ndim}, chunks=True
    ),
    "userblock": lambda path: write_h5py(path, mixed(np.random.default_rng(6)), userblock=512, libver="latest"),
    "chunked-latest": lambda path: write_h5py(
        path, {k: v for k, v in mixed(np.random.default_rng(5)).items() if v.ndim}, chunks=True, libver="latest"
    ),
    # superblock version 2: what libhdf5 1.8 writes (libver v108); version 3 is "latest"'s, 0 "earliest"'s
    "superblock-v2": lambda path: write_h5py(path, mixed(np.random.default_rng(7)), libver="v108"),
    # superblock version 1: a chunk B-tree K of 2 (nodes of at most 4 chunks: a tree of several levels)
    "superblock-v1": lambda path: write_h5py(
        path,
        {"long": np.arange(40_000, dtype=np.float32)}
        | {k: v for k, v in mixed(np.random.default_rng(8)).items() if v.ndim},
        chunks=True,
        istore_k=2,
    ),
}
