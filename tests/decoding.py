"""Reference decodings the view tests compare with: ml_dtypes' own casts, an independent bit-level decoder
for F4 and F6, random source bytes with every code, and a ``.npy`` header parsed by the format's definition."""

from __future__ import annotations

import ast
import struct

import ml_dtypes
import numpy as np

from stfs.formats.dtypes import DTYPE_BITS

ML_DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
    "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "F16": np.float16,
    "F64": np.float64,
}
# (exponent bits, mantissa bits, bias) of the sub-byte dtypes: OCP MX formats, no inf, no NaN
MINIFLOATS = {"F4": (2, 1, 1), "F6_E2M3": (2, 3, 1), "F6_E3M2": (3, 2, 3)}


def minifloat_reference(data: bytes, dtype: str) -> np.ndarray:
    """F4/F6 values by the bit-level definition: element k is bits ``k*w .. k*w+w-1`` of the little-endian bit
    stream (numpy's unpackbits, not stfs's shifts), then sign, exponent and mantissa by the formula."""
    exponent_bits, mantissa_bits, bias = MINIFLOATS[dtype]
    width = 1 + exponent_bits + mantissa_bits
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little").reshape(-1, width)
    codes = (bits.astype(np.int64) << np.arange(width)).sum(axis=1)
    sign = np.where(codes >> (width - 1), -1.0, 1.0)
    exponent = (codes >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = (codes & ((1 << mantissa_bits) - 1)) / (1 << mantissa_bits)
    magnitude = np.where(
        exponent == 0, mantissa * 2.0 ** (1 - bias), (1 + mantissa) * 2.0 ** (exponent.astype(float) - bias)
    )
    return (sign * magnitude).astype(np.float32)


def reference(data: bytes, dtype: str) -> np.ndarray:
    """The float32 values of ``data`` as ``dtype`` (the reference the views must equal)."""
    if dtype in MINIFLOATS:
        return minifloat_reference(data, dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.frombuffer(data, dtype=ML_DTYPES[dtype]).astype(np.float32)


def every_code(dtype: str, values: int, seed: int = 0) -> bytes:
    """Random source bytes for ``values`` values of ``dtype``; 8-bit dtypes get every code at least once."""
    rng = np.random.default_rng(seed)
    size = values * DTYPE_BITS[dtype] // 8
    data = rng.integers(0, 256, size, dtype=np.uint8)
    if DTYPE_BITS[dtype] == 8:
        data[:256] = np.arange(256, dtype=np.uint8)
    return data.tobytes()


def parse_npy_header(data: bytes) -> tuple[tuple[int, int], dict[str, object], int]:
    """(version, header dict, data start) of a .npy file, by the format's definition."""
    assert data[:6] == b"\x93NUMPY"
    version = (data[6], data[7])
    if version == (1, 0):
        (length,) = struct.unpack("<H", data[8:10])
        start = 10 + length
    else:
        (length,) = struct.unpack("<I", data[8:12])
        start = 12 + length
    text = data[start - length : start]
    assert text.endswith(b"\n")
    return version, ast.literal_eval(text.decode("latin1")), start
