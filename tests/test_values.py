"""The kernels of ``stfs diff`` and ``stfs check --values`` (``stfs.values``) against NumPy and ml_dtypes."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from stfs.decode import code_values, to_float64
from stfs.values import (
    Specials,
    Tally,
    add_norm,
    compare_values,
    count_specials,
    count_unequal_elements,
    has_specials,
    may_hold_specials,
    same_bytes,
    values_per_chunk,
)

SMALL_FLOATS = ["BF16", "F16", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"]


@pytest.mark.parametrize("dtype", SMALL_FLOATS)
def test_every_code_of_a_small_float_is_flagged_exactly_when_it_is_nan_or_infinite(dtype: str) -> None:
    values = code_values(dtype)
    codes = np.arange(len(values), dtype=np.uint16 if len(values) > 256 else np.uint8)
    raw = codes.view(np.uint8)
    width = raw.itemsize * (2 if len(values) > 256 else 1)
    scratch = np.empty(len(raw), dtype=np.uint8)
    flagged = [may_hold_specials(dtype, raw[i * width : (i + 1) * width], scratch) for i in range(len(values))]
    assert flagged == list(~np.isfinite(values))
    found = Specials()
    count_specials(dtype, raw, 0, found, np.empty(len(values)))
    assert (found.nan, found.posinf, found.neginf) == (
        int(np.isnan(values).sum()),
        int((values == np.inf).sum()),
        int((values == -np.inf).sum()),
    )
    assert found.first == int(np.argmax(~np.isfinite(values)))


@pytest.mark.parametrize(("dtype", "numpy_dtype"), [("F32", np.float32), ("F64", np.float64)])
def test_wide_floats_are_flagged_by_their_bits(dtype: str, numpy_dtype: type) -> None:
    info = np.finfo(numpy_dtype)
    finite = np.array([0.0, -0.0, info.max, -info.max, info.tiny, info.smallest_subnormal, 1.5], dtype=numpy_dtype)
    scratch = np.empty(64, dtype=np.uint8)
    assert not may_hold_specials(dtype, finite.view(np.uint8), scratch)
    unsigned = np.uint32 if numpy_dtype is np.float32 else np.uint64
    quiet_nan = np.array([np.nan], dtype=numpy_dtype)
    payload_nan = (quiet_nan.view(unsigned) | unsigned(1)).view(numpy_dtype)  # a NaN with another payload
    signalling = (np.array([np.inf], dtype=numpy_dtype).view(unsigned) | unsigned(1)).view(numpy_dtype)
    for special in (np.inf, -np.inf, np.nan, -np.nan, payload_nan[0], signalling[0]):
        chunk = finite.copy()
        chunk[3] = special
        assert may_hold_specials(dtype, chunk.view(np.uint8), scratch), special


def test_counts_and_first_index_over_chunks() -> None:
    values = np.ones(1000, dtype=np.float32)
    values[[10, 600]] = np.nan
    values[700] = np.inf
    values[[5, 900, 901]] = -np.inf
    found = Specials()
    out = np.empty(500)
    for start in (0, 500):
        count_specials("F32", values[start : start + 500].view(np.uint8), start, found, out)
    assert (found.nan, found.posinf, found.neginf, found.first) == (2, 1, 3, 5)


def test_integers_and_sub_byte_floats_have_no_specials() -> None:
    for dtype in ("BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F4", "F6_E2M3", "F6_E3M2", "C64"):
        assert not has_specials(dtype)
    for dtype in [*SMALL_FLOATS, "F32", "F64"]:
        assert has_specials(dtype)


def test_same_bytes() -> None:
    a = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    b = a.copy()
    assert same_bytes(a, b)
    assert same_bytes(a[:0], b[:0])
    b[-1] ^= 1
    assert not same_bytes(a, b)
    assert same_bytes(a[:-1], b[:-1])
    assert not same_bytes(a[:10], b[:11])


def test_unequal_elements_by_bytes() -> None:
    a = np.zeros(80, dtype=np.uint8)
    b = a.copy()
    b[[0, 7, 8, 79]] = 1  # elements 0, 0, 1, 9 of 8 bytes
    assert count_unequal_elements(a, b, 8) == 3


def test_chunks_are_whole_groups_of_every_dtype() -> None:
    for dtypes in (("F4",), ("F6_E2M3",), ("BF16", "F32"), ("F6_E3M2", "F64"), ("U8",)):
        values = values_per_chunk(1 << 20, *dtypes)
        assert values % 8 == 0 and values > 0


def reference(a: np.ndarray, b: np.ndarray, atol: float, rtol: float) -> tuple[int, float | None, int, float | None]:
    """What SPEC §10 says, written the plain way: differ, max |a-b| over both finite, its first index, rel_l2."""
    with np.errstate(invalid="ignore", over="ignore"):
        differ = int((~np.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)).sum())
        finite = np.isfinite(a) & np.isfinite(b)
        gaps = np.where(finite, np.abs(a - b), 0.0)
        norm = math.sqrt(float(np.sum(np.where(finite, a, 0.0) ** 2)))
    largest = float(gaps.max()) if len(gaps) else 0.0
    where = int(np.argmax(gaps)) if largest > 0 else -1
    rel = math.sqrt(float(np.sum(gaps**2)))
    return differ, (largest if largest > 0 else None), where, (rel / norm if rel else 0.0) if norm or not rel else None


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize(("atol", "rtol"), [(0.0, 0.0), (0.1, 0.0), (0.0, 0.05), (1e-3, 1e-2)])
def test_compare_values_agrees_with_numpy_isclose(seed: int, atol: float, rtol: float) -> None:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(300)
    b = a + rng.standard_normal(300) * rng.choice([0.0, 1e-3, 0.1, 1.0], 300)
    specials = [np.nan, np.inf, -np.inf, 0.0, -0.0]
    for side in (a, b):
        picks = rng.integers(0, 300, 20)
        side[picks] = rng.choice(specials, 20)
    a[7], b[7] = np.nan, np.nan  # both NaN: equal
    a[8], b[8] = np.inf, np.inf  # the same infinity: equal
    a[9], b[9] = 0.0, -0.0  # equal
    tally = Tally()
    for start in range(0, 300, 128):  # chunks, as the caller feeds them
        compare_values(a[start : start + 128], b[start : start + 128], start, atol, rtol, tally)
    differ, largest, where, rel = reference(a, b, atol, rtol)
    assert tally.differ == differ
    assert (tally.max_abs if tally.where >= 0 else None) == largest
    assert tally.where == where
    assert tally.rel_l2 == pytest.approx(rel, rel=1e-12)


def test_norm_of_equal_values_counts_towards_rel_l2() -> None:
    tally = Tally()
    compare_values(np.array([3.0]), np.array([0.0]), 0, 0.0, 0.0, tally)
    add_norm(np.array([4.0, np.inf, np.nan]), tally)
    assert tally.rel_l2 == pytest.approx(3.0 / 5.0)
    assert (tally.differ, tally.max_abs, tally.where) == (1, 3.0, 0)


def test_rel_l2_of_a_zero_tensor() -> None:
    zero = Tally()
    compare_values(np.zeros(3), np.zeros(3), 0, 0.0, 0.0, zero)
    assert zero.rel_l2 == 0.0
    changed = Tally()
    compare_values(np.zeros(3), np.ones(3), 0, 0.0, 0.0, changed)
    assert changed.rel_l2 is None  # infinite: no number


REFERENCE = {
    "BF16": ml_dtypes.bfloat16,
    "F16": np.dtype("<f2"),
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
    "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    **{dtype: np.dtype(code) for dtype, code in {"BOOL": "?", "U8": "u1", "I8": "i1", "I16": "<i2"}.items()},
    **{dtype: np.dtype(code) for dtype, code in {"U16": "<u2", "F32": "<f4", "F64": "<f8", "I32": "<i4"}.items()},
    **{dtype: np.dtype(code) for dtype, code in {"U32": "<u4", "I64": "<i8", "U64": "<u8"}.items()},
}


@pytest.mark.parametrize("dtype", sorted(REFERENCE))
def test_to_float64_is_numpy_and_ml_dtypes_cast(dtype: str) -> None:
    """``decode.to_float64`` (BF16 by a shift, NumPy's dtypes without ml_dtypes) gives the values NumPy's and
    ml_dtypes' casts give, for a chunk as an array and as a memoryview."""
    raw = np.tile(np.arange(1 << 16, dtype=np.uint16).view(np.uint8), 4)
    if REFERENCE[dtype] == np.dtype("?"):
        raw = raw.clip(0, 1)  # NumPy reads a BOOL byte other than 0 or 1 as its own value: no cast to compare
    with np.errstate(invalid="ignore", over="ignore"):
        theirs = raw.view(REFERENCE[dtype]).astype(np.float64)
    for given in (raw, raw.data):
        mine = to_float64(dtype, given, np.empty(len(raw))).copy()
        assert np.array_equal(mine, theirs, equal_nan=True)
        assert np.array_equal(np.signbit(mine), np.signbit(theirs))


@pytest.mark.parametrize("dtype", ["F4", "F6_E2M3", "F6_E3M2"])
def test_to_float64_of_packed_dtypes_is_their_code_values(dtype: str) -> None:
    raw = np.tile(np.arange(256, dtype=np.uint8), 3)  # whole F6 groups of three bytes
    per_byte = 2 if dtype == "F4" else 4 / 3
    mine = to_float64(dtype, raw, np.empty(2 * len(raw)))
    assert len(mine) == int(len(raw) * per_byte)
    if dtype == "F4":  # the low nibble first
        expected = code_values(dtype)[np.stack([raw & 0xF, raw >> 4], axis=1).reshape(-1)]
        assert np.array_equal(mine, expected, equal_nan=True)
    assert np.array_equal(mine, to_float64(dtype, raw.data, np.empty(2 * len(raw))), equal_nan=True)


def test_bf16_table_matches_ml_dtypes() -> None:
    """The magnitudes flagged for BF16 are those ml_dtypes decodes to NaN or inf (one more check of the table)."""
    codes = np.arange(1 << 16, dtype=np.uint16)
    with np.errstate(invalid="ignore"):
        values = codes.view(ml_dtypes.bfloat16).astype(np.float64)
    assert ((codes & 0x7FFF) >= 0x7F80).tolist() == (~np.isfinite(values)).tolist()


def test_bf16_values_stats_and_heatmaps_need_no_ml_dtypes() -> None:
    """BF16 is float32's upper half: its values, stats/ and png/ files are made without importing ml_dtypes (a
    second of a daemon's first read), which only the F8, F6 and F4 dtypes need."""
    import subprocess
    import sys

    program = """
import sys
import numpy as np
from stfs.chunks import TensorBytes
from stfs.heatmap import heatmap_file, png_size
from stfs.tensor_stats import stats_file
from stfs.formats import TensorEntry
from stfs.tensor_stats import stats_size

data = np.arange(1 << 16, dtype=np.uint16).tobytes()
def read(key, offset, view, span):
    view[:] = data[offset : offset + len(view)]
    return len(view)
entry = TensorEntry("t", "BF16", (256, 256), 0, len(data))
tensor = TensorBytes("k", 0, len(data), "BF16", entry.shape, read)
import json
assert json.loads(stats_file(tensor, stats_size(entry)))["finite"] == 65536 - 256  # 254 NaN codes, 2 infinities
assert heatmap_file(tensor, png_size(entry.shape)).startswith(b"\\x89PNG")
print("ml_dtypes" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
