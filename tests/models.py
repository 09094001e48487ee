"""Fixture models: valid ones written by the real ``safetensors`` package, broken ones by hand (struct + json)."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np
import safetensors
from safetensors.numpy import save_file

# safetensors.serialize dtype names for the dtypes numpy cannot hold.
RAW_DTYPES = {
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
}


def rich_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """Every numpy dtype safetensors writes, 0-rank, empty and nested names."""
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((64, 16)).astype(np.float32),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((32, 16)).astype(np.float16),
        "model.layers.0.mlp.up_proj.bias": rng.standard_normal(32).astype(np.float64),
        "model.layers.1.self_attn.q_proj.weight": rng.integers(-100, 100, (8, 8)).astype(np.int8),
        "counts.u8": rng.integers(0, 255, 17).astype(np.uint8),
        "counts.i16": rng.integers(-999, 999, (3, 5)).astype(np.int16),
        "counts.u16": rng.integers(0, 999, 7).astype(np.uint16),
        "counts.i32": rng.integers(-(2**30), 2**30, 9).astype(np.int32),
        "counts.u32": rng.integers(0, 2**31, 9).astype(np.uint32),
        "counts.i64": rng.integers(-(2**60), 2**60, 5).astype(np.int64),
        "counts.u64": rng.integers(0, 2**62, 5).astype(np.uint64),
        "flags": rng.integers(0, 2, 11).astype(bool),
        "complex": (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def write_numpy(path: str, arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> str:
    save_file(arrays, path, metadata=metadata)
    return path


def write_raw(
    path: str, tensors: dict[str, tuple[str, list[int], bytes]], metadata: dict[str, str] | None = None
) -> str:
    """Write tensors given as (safetensors dtype, shape, bytes) with ``safetensors.serialize`` (BF16, F8, ...)."""
    keep: list[np.ndarray] = []
    specs = {}
    for name, (dtype, shape, data) in tensors.items():
        buffer = np.frombuffer(data, dtype=np.uint8).copy() if data else np.zeros(1, dtype=np.uint8)
        keep.append(buffer)
        specs[name] = safetensors.TensorSpec(
            dtype=RAW_DTYPES[dtype][0], shape=shape, data_ptr=buffer.ctypes.data, data_len=len(data)
        )
    with open(path, "wb") as stream:
        stream.write(bytes(safetensors.serialize(specs, metadata=metadata)))
    return path


# SPEC §8: the dtypes whose values are floats (f32/ files, heatmaps); the others are integers, BOOL and C64
FLOAT_DTYPES = frozenset({"F4", "F6_E2M3", "F6_E3M2", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"})
FLOAT_DTYPES |= {"F16", "BF16", "F32", "F64"}


def read_tensors(path: str | os.PathLike[str]) -> list[tuple[str, str, tuple[int, ...], bytes, int]]:
    """Every tensor of a safetensors file, read straight from it (independent of stfs):
    (name, dtype, shape, bytes, absolute offset of its data)."""
    with open(path, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        header = json.loads(stream.read(length))
        data = stream.read()
    return [
        (name, info["dtype"], tuple(info["shape"]), data[begin:end], 8 + length + begin)
        for name, info in header.items()
        if name != "__metadata__"
        for begin, end in [info["data_offsets"]]
    ]


# safetensors.serialize's name of every dtype it writes (all but F6); F4 is given in storage shape (two values a byte)
SERIALIZE_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
}
Tensors = dict[str, tuple[str, list[int], bytes]]  # name -> (safetensors dtype, shape, bytes)


def write_serialized(path: str | os.PathLike[str], tensors: Tensors) -> None:
    """Tensors of any dtype but F6 written by the real safetensors package (``safetensors.serialize``)."""
    keep, specs = [], {}
    for name, (dtype, shape, data) in tensors.items():
        buffer = np.frombuffer(data, dtype=np.uint8).copy() if data else np.zeros(1, dtype=np.uint8)
        keep.append(buffer)
        storage = shape[:-1] + [shape[-1] // 2] if dtype == "F4" and shape else shape
        specs[name] = safetensors.TensorSpec(
            dtype=SERIALIZE_NAMES[dtype], shape=storage, data_ptr=buffer.ctypes.data, data_len=len(data)
        )
    with open(path, "wb") as stream:
        stream.write(bytes(safetensors.serialize(specs)))


def write_by_hand(path: str | os.PathLike[str], tensors: Tensors) -> None:
    """Tensors safetensors cannot write (F6), with struct and json."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    write_header(str(path), header, data)


def write_header(path: str, header: Any, data: bytes = b"", length: int | None = None, raw: bytes | None = None) -> str:
    """Write a file by hand: 8-byte length, header (JSON of ``header`` or ``raw`` bytes), then ``data``."""
    body = raw if raw is not None else json.dumps(header).encode()
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(body) if length is None else length))
        stream.write(body)
        stream.write(data)
    return path


def write_sharded(
    folder: str,
    shards: dict[str, dict[str, np.ndarray]],
    weight_map: dict[str, str] | None = None,
    index_name: str = "model.safetensors.index.json",
    total_size: int | None = None,
    metadata: dict[str, dict[str, str]] | None = None,
) -> str:
    """A sharded set: each shard written by safetensors, an index mapping every tensor to its shard."""
    os.makedirs(folder, exist_ok=True)
    computed_map: dict[str, str] = {}
    total = 0
    for shard_name, arrays in shards.items():
        save_file(arrays, os.path.join(folder, shard_name), metadata=(metadata or {}).get(shard_name))
        for name, array in arrays.items():
            computed_map[name] = shard_name
            total += array.nbytes
    index = {
        "metadata": {"total_size": total if total_size is None else total_size},
        "weight_map": computed_map if weight_map is None else weight_map,
    }
    path = os.path.join(folder, index_name)
    with open(path, "w") as stream:
        json.dump(index, stream, indent=2)
    return path


def sharded_arrays(seed: int = 1) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {
        "model-00001-of-00002.safetensors": {
            "model.embed_tokens.weight": rng.standard_normal((50, 8)).astype(np.float32),
            "model.layers.0.input_layernorm.weight": rng.standard_normal(8).astype(np.float32),
        },
        "model-00002-of-00002.safetensors": {
            "model.layers.0.mlp.down_proj.weight": rng.standard_normal((8, 24)).astype(np.float16),
            "lm_head.weight": rng.standard_normal((50, 8)).astype(np.float32),
        },
    }


def tensor_bytes(path: str, name: str) -> bytes:
    """The bytes of tensor ``name`` read straight from the safetensors file (independent of stfs)."""
    with open(path, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        header = json.loads(stream.read(length))
        begin, end = header[name]["data_offsets"]
        stream.seek(8 + length + begin)
        return stream.read(end - begin)


# Tensor names that stress the path rules: dots, escapes, prefixes of each other, the empty name.
WEIRD_NAMES = [
    "plain",
    "a.b",
    "a.b.c",  # a.b is also a prefix of a.b.c
    "a.b.c.d",
    "x/y",
    "100%",
    "%2F",
    "nul\x00byte",
    "a..b",
    ".hidden",
    "trailing.",
    ".",
    "..",
    "...",
    "",
    "a.%",
    "unicodé.名前",
]
