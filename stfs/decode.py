"""Decoding tensor bytes to float32, and ``.npy`` headers: what the ``npy/`` and ``f32/`` views are made of;
and to float64 values or per-value codes, what ``stats/`` and ``png/`` are computed from.

Every float dtype of safetensors 0.8 decodes through ``ml_dtypes``'s own conversions: the 8-, 6- and
4-bit ones by a table of every code's float32 value (built once with ``astype``), BF16, F16 and F64 by
a cast. NaN codes give NaN, subnormals are kept, F64 rounds to nearest-even (out of range: ±inf).

Packing of the sub-byte dtypes, in C order over the whole tensor:

* F4 (``float4_e2m1fn``): two values per byte, the low nibble first (torch's ``float4_e2m1fn_x2``,
  which the safetensors reference maps F4 to);
* F6 (``float6_e2m3fn``, ``float6_e3m2fn``): four values in three bytes, value k in bits 6k..6k+5 of
  the little-endian 24-bit group (the reference gives F6 a width of 6 bits and no packing of its own).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np
from numpy.lib import format as npy_format

from . import formats
from .formats.dtypes import DTYPE_BITS

F32 = np.dtype("<f4")

# Dtypes NumPy holds natively: their bytes go into npy/ unchanged (safetensors is little-endian).
NATIVE: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "F32": F32,
    "C64": np.dtype("<c8"),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
}

# The ml_dtypes type of each one-value-per-byte code (ml_dtypes keeps a sub-byte value in the low bits of a byte).
_CODES = {
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F6_E2M3": "float6_e2m3fn",
    "F6_E3M2": "float6_e3m2fn",
    "F4": "float4_e2m1fn",
}


@cache
def _code_type(dtype: str) -> type:
    """ml_dtypes' type for ``dtype`` (BF16 or one of ``_CODES``): imported when first needed, as it takes a second."""
    import ml_dtypes

    found: type = getattr(ml_dtypes, "bfloat16" if dtype == "BF16" else _CODES[dtype])
    return found


_CODE_BITS = {"F6_E2M3": 6, "F6_E3M2": 6, "F4": 4}


@dataclass(frozen=True, slots=True)
class Codec:
    """How one dtype becomes float32: ``group_bytes`` source bytes hold ``group_values`` values (a whole
    number of bytes: F4 2 values in 1 byte, F6 4 in 3, the rest one value in its own bytes).

    ``decode(source, out)`` turns whole groups of source bytes into their float32 values (``out`` holds
    4 bytes per value) without allocating more than a few times the chunk it is given.
    """

    dtype: str
    group_bytes: int
    group_values: int
    decode: Callable[[memoryview, memoryview], None]

    @property
    def group_out(self) -> int:
        """Bytes of float32 per group."""
        return 4 * self.group_values


def table(dtype: str) -> np.ndarray:
    """The float32 value of every code of a 4-, 6- or 8-bit float dtype, by ``ml_dtypes``'s own cast."""
    bits = _CODE_BITS.get(dtype, 8)
    return np.arange(1 << bits, dtype=np.uint8).view(_code_type(dtype)).astype(np.float32)


def _floats(out: memoryview) -> np.ndarray:
    return np.frombuffer(out, dtype=F32)


def _cast(source_dtype: np.dtype | type) -> Callable[[memoryview, memoryview], None]:
    def decode(source: memoryview, out: memoryview) -> None:
        with np.errstate(over="ignore", invalid="ignore"):  # F64: ±inf beyond float32, NaN stays NaN (IEEE cast)
            np.copyto(_floats(out), np.frombuffer(source, dtype=source_dtype), casting="unsafe")

    return decode


def _bfloat16(source: memoryview, out: memoryview) -> None:
    """BF16 is float32's upper half: shifted into place, exactly (a NaN stays NaN)."""
    np.left_shift(np.frombuffer(source, dtype="<u2"), 16, out=_floats(out).view(np.uint32), dtype=np.uint32)


def _byte_codes(dtype: str) -> Callable[[memoryview, memoryview], None]:
    def decode(source: memoryview, out: memoryview) -> None:
        np.take(table(dtype), np.frombuffer(source, dtype=np.uint8), out=_floats(out), mode="clip")

    return decode


@cache
def _nibble_pairs(dtype: str) -> np.ndarray:
    """The two float32 values of every byte of a 4-bit dtype, the low nibble first."""
    values = table(dtype)
    byte = np.arange(256)
    return np.ascontiguousarray(np.stack([values[byte & 0xF], values[byte >> 4]], axis=1))


def _nibbles(dtype: str) -> Callable[[memoryview, memoryview], None]:
    def decode(source: memoryview, out: memoryview) -> None:
        pairs = _nibble_pairs(dtype)
        np.take(pairs, np.frombuffer(source, dtype=np.uint8), axis=0, out=_floats(out).reshape(-1, 2), mode="clip")

    return decode


def _sextet_codes(source: memoryview | np.ndarray) -> np.ndarray:
    """The 6-bit codes of whole 3-byte groups, four a group: value k is bits 6k..6k+5 of the little-endian 24 bits."""
    triples = np.frombuffer(source, dtype=np.uint8).reshape(-1, 3).astype(np.uint32)
    group = triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)
    codes = np.empty((len(group), 4), dtype=np.uint8)
    for k in range(4):
        codes[:, k] = (group >> (6 * k)) & 0x3F
    return codes


def _sextets(dtype: str) -> Callable[[memoryview, memoryview], None]:
    def decode(source: memoryview, out: memoryview) -> None:
        np.take(table(dtype), _sextet_codes(source), out=_floats(out).reshape(-1, 4), mode="clip")

    return decode


def _codecs() -> dict[str, Codec]:
    codecs = {
        "BF16": Codec("BF16", 2, 1, _bfloat16),
        "F16": Codec("F16", 2, 1, _cast(np.dtype("<f2"))),
        "F64": Codec("F64", 8, 1, _cast(np.dtype("<f8"))),
        "F4": Codec("F4", 1, 2, _nibbles("F4")),
        "F6_E2M3": Codec("F6_E2M3", 3, 4, _sextets("F6_E2M3")),
        "F6_E3M2": Codec("F6_E3M2", 3, 4, _sextets("F6_E3M2")),
    }
    for dtype in ("F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"):
        codecs[dtype] = Codec(dtype, 1, 1, _byte_codes(dtype))
    return codecs


# F32 is absent: its f32/ file is its own bytes.
CODECS: dict[str, Codec] = _codecs()


def codec(dtype: str) -> Codec | None:
    """How ``dtype`` becomes float32; ``None`` for F32 (its own bytes) and for dtypes with no float value to give:
    integers, BOOL, C64, and GGML types the ``gguf`` package cannot decode (Q8_1, Q8_K, Q1_0)."""
    return CODECS.get(dtype) or _format_codec(dtype)


def has_values(dtype: str) -> bool:
    """Whether ``dtype``'s values can be read as numbers (``stats/``): every dtype but C64 and the GGML types the
    ``gguf`` package cannot decode."""
    return dtype in DTYPE_BITS and dtype != "C64" or _format_codec(dtype) is not None


def is_float(dtype: str) -> bool:
    """A float dtype of safetensors, or a GGML type the ``gguf`` package decodes (a quantized type's values are
    floats)."""
    return dtype in FLOATS or _format_codec(dtype) is not None


FLOATS = frozenset({"F4", "F6_E2M3", "F6_E3M2", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}) | {
    "F16",
    "BF16",
    "F32",
    "F64",
}


@cache
def _format_codec(dtype: str) -> Codec | None:
    """The decoding of a dtype its format decodes itself (a GGML type: ``gguf.quants.dequantize`` of whole blocks,
    as ggml computes them); ``None`` for another dtype, or one no decoding is known for (Q8_K)."""
    if dtype in DTYPE_BITS:  # named alike in every format (F32, F16, BF16, F64, I8-I64): the same values
        return None
    try:
        found = formats.dtype(dtype)
    except KeyError:
        return None
    if found.decode is None:
        return None
    return Codec(dtype, found.group_bytes, found.group_values, found.decode)


def npy_header(descr: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` header ``numpy.lib.format`` writes for a C-order array of ``descr`` and ``shape``: format
    1.0, or 2.0 where the header passes 64 KiB; the data start padded to numpy's alignment."""
    header = {"descr": npy_format.dtype_to_descr(descr), "fortran_order": False, "shape": tuple(shape)}
    stream = io.BytesIO()
    try:
        npy_format.write_array_header_1_0(stream, header)
    except ValueError:  # "Header length ... too big for version=(1, 0)": thousands of dimensions
        stream = io.BytesIO()
        npy_format.write_array_header_2_0(stream, header)
    return stream.getvalue()


# -- float64 values and codes, for stats/ and png/ ---------------------------------------------------------------

# Dtypes of at most 16 bits: a tensor's values are counted by code (np.bincount), one pass for every statistic.
CODED = frozenset(("BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", *_CODES))


def _code_dtype(dtype: str) -> np.dtype | type:
    """What NumPy reads the codes of a ``CODED`` dtype of whole bytes as."""
    return NATIVE.get(dtype) or _code_type(dtype)


@cache
def code_values(dtype: str) -> np.ndarray:
    """The float64 value of every code of a ``CODED`` dtype (a BOOL byte other than 0 is True, as in NumPy)."""
    if dtype in _CODE_BITS:
        return table(dtype).astype(np.float64)
    codes = np.arange(1 << DTYPE_BITS[dtype], dtype=_unsigned(dtype))
    with np.errstate(invalid="ignore"):
        if dtype == "BF16":  # float32's upper half: no ml_dtypes (a second to import) for the commonest dtype
            return np.left_shift(codes, 16, dtype=np.uint32).view(np.float32).astype(np.float64)
        return codes.view(_code_dtype(dtype)).astype(np.float64)


def _unsigned(dtype: str) -> np.dtype:
    return np.dtype("u1") if DTYPE_BITS[dtype] == 8 else np.dtype("<u2")


def codes(dtype: str, source: memoryview | np.ndarray) -> np.ndarray:
    """The code of each value in ``source`` (whole groups of a ``CODED`` dtype), in C order."""
    if dtype == "F4":
        pairs = np.frombuffer(source, dtype=np.uint8)
        found = np.empty(2 * len(pairs), dtype=np.uint8)
        np.bitwise_and(pairs, 0xF, out=found[0::2])  # the low nibble first
        np.right_shift(pairs, 4, out=found[1::2])
        return found
    if dtype in _CODE_BITS:
        return _sextet_codes(source).reshape(-1)
    return np.frombuffer(source, dtype=_unsigned(dtype))


def to_float64(dtype: str, source: memoryview | np.ndarray, out: np.ndarray) -> np.ndarray:
    """The values of ``source`` (whole groups of ``dtype``, not C64) as float64, written into the start of ``out``:
    the part of ``out`` that holds them. ml_dtypes is imported only once an F8, F6 or F4 chunk is decoded."""
    if dtype in _CODE_BITS:
        found = codes(dtype, source)
        return np.take(code_values(dtype), found, out=out[: len(found)], mode="clip")
    if dtype not in DTYPE_BITS:  # a dtype its format decodes (a GGML type): its float32 values
        decoding = _format_codec(dtype)
        assert decoding is not None
        count = len(source) // decoding.group_bytes * decoding.group_values
        floats = bytearray(4 * count)
        decoding.decode(np.frombuffer(source, dtype=np.uint8).data, memoryview(floats))
        np.copyto(out[:count], np.frombuffer(floats, dtype=F32))
        return out[:count]
    if dtype == "BF16":  # float32's upper half: shifted back into place, exactly (NaN stays NaN)
        values = np.left_shift(np.frombuffer(source, dtype="<u2"), 16, dtype=np.uint32).view(np.float32)
    else:
        values = np.frombuffer(source, dtype=NATIVE.get(dtype) or _code_type(dtype))
    with np.errstate(invalid="ignore"):  # a NaN code cast to float64 is NaN, as meant
        np.copyto(out[: len(values)], values, casting="unsafe")  # exact: every dtype but C64 fits in float64 ...
    return out[: len(values)]  # ... except 64-bit integers past 2**53, rounded to nearest as NumPy's astype does
