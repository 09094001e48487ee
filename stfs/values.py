"""The kernels of ``stfs diff`` and ``stfs check --values``: a chunk of two tensors compared, a chunk scanned for
NaN and infinities. No I/O here: chunks come in as NumPy arrays of raw bytes (``uint8``).

Raw bits first, values only where they are needed:

* two chunks with the same bytes hold the same values: ``memcmp`` (libc's, through ctypes) answers at the
  speed of memory, and nothing is decoded;
* a NaN or an infinity of an IEEE-like float is a bit pattern: its magnitude bits (the sign cleared) at or
  above those of the infinity (or of the NaN, for the F8 kinds without an infinity). One ``bitwise_and`` and
  one ``max`` per chunk tell whether it holds any; only a chunk that does is decoded to count them.

Values are float64 as ``decode.to_float64`` gives them (BF16, F8, F6, F4 decoded as the views decode them,
integers and BOOL as their values).
C64 has none: it is compared by bytes only.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np

from .decode import has_values, to_float64
from .formats import groups
from .formats.dtypes import DTYPE_BITS as DTYPES

_libc = ctypes.CDLL(None)
_memcmp = _libc.memcmp
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)

# (bits as, mask of the magnitude bits, the smallest magnitude that is NaN or an infinity): every magnitude from
# there up is one (tests/test_values.py checks each code of the 8- and 16-bit kinds against ml_dtypes).
_SPECIAL: dict[str, tuple[np.dtype, int, int]] = {
    "F16": (np.dtype("<u2"), 0x7FFF, 0x7C00),
    "BF16": (np.dtype("<u2"), 0x7FFF, 0x7F80),
    "F32": (np.dtype("<u4"), 0x7FFF_FFFF, 0x7F80_0000),
    "F64": (np.dtype("<u8"), 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
    "F8_E5M2": (np.dtype("u1"), 0x7F, 0x7C),
    "F8_E4M3": (np.dtype("u1"), 0x7F, 0x7F),  # no infinity: 0x7F and 0xFF are NaN
    "F8_E8M0": (np.dtype("u1"), 0xFF, 0xFF),  # no sign, no infinity: 0xFF is NaN
}
_NEGATIVE_ZERO_NAN = frozenset({"F8_E4M3FNUZ", "F8_E5M2FNUZ"})  # their one NaN is the code 0x80, nothing infinite


def values_known(dtype: str) -> bool:
    """Whether ``dtype``'s values can be compared (as float64); C64 and the GGML types the ``gguf`` package does not
    decode: bytes only."""
    return has_values(dtype)


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two ``uint8`` arrays hold the same bytes (``memcmp``: no temporary, memory speed)."""
    if len(a) != len(b):
        return False
    return len(a) == 0 or _memcmp(a.ctypes.data, b.ctypes.data, len(a)) == 0


def values_per_chunk(chunk_bytes: int, *dtypes: str) -> int:
    """How many values make a chunk of about ``chunk_bytes`` bytes of the widest of ``dtypes``: whole groups of every
    dtype (F4 two values a byte, F6 four in three bytes, a GGML type its block; ``formats.groups``)."""
    whole = math.lcm(8, *(groups(dtype)[0] for dtype in dtypes))
    fewest = min(chunk_bytes * groups(dtype)[0] // groups(dtype)[1] for dtype in dtypes)
    return max(whole, fewest // whole * whole)


def byte_count(dtype: str, values: int) -> int:
    """The bytes of ``values`` values of ``dtype`` (whole groups)."""
    group_values, group_bytes = groups(dtype)
    return values // group_values * group_bytes


def value_count(dtype: str, size: int) -> int:
    """The values in ``size`` bytes of ``dtype`` (whole groups)."""
    group_values, group_bytes = groups(dtype)
    return size // group_bytes * group_values


# -- NaN and infinities --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Specials:
    """NaN and infinities counted over a tensor, and the flat index of the first of any of them (-1: none)."""

    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    first: int = -1

    @property
    def any(self) -> bool:
        return self.first >= 0


def has_specials(dtype: str) -> bool:
    """Whether values of ``dtype`` can be NaN or infinite (not integers, BOOL, F6, F4; not C64, compared by bytes);
    a quantized GGML type can (its scales are floats)."""
    return dtype in _SPECIAL or dtype in _NEGATIVE_ZERO_NAN or _quantized(dtype)


def _quantized(dtype: str) -> bool:
    """A GGML type the ``gguf`` package decodes whose values are not one float's bits: its blocks are decoded to be
    looked at."""
    return dtype not in DTYPES and has_values(dtype)


def may_hold_specials(dtype: str, raw: np.ndarray, scratch: np.ndarray) -> bool:
    """Whether the chunk ``raw`` (whole values of ``dtype``, one that ``has_specials``) may hold a NaN or an infinity
    (``False``: it holds none), from its bits; ``scratch``: a ``uint8`` array at least as long as ``raw``."""
    if not len(raw):
        return False
    if dtype not in _SPECIAL and dtype not in _NEGATIVE_ZERO_NAN:  # a quantized GGML type: no bit to look at
        return True
    if dtype in _NEGATIVE_ZERO_NAN:
        return bool(np.count_nonzero(raw == 0x80))
    unsigned, mask, first = _SPECIAL[dtype]
    bits = raw.view(unsigned)
    magnitudes = np.bitwise_and(bits, mask, out=scratch[: len(raw)].view(unsigned))
    return int(magnitudes.max()) >= first


def count_specials(dtype: str, raw: np.ndarray, first_index: int, found: Specials, out: np.ndarray) -> None:
    """Add the NaN and infinities of the chunk ``raw`` (values of ``dtype`` from flat index ``first_index``) to
    ``found``; ``out``: a float64 array for at least the chunk's values."""
    values = to_float64(dtype, raw, out)
    bad = ~np.isfinite(values)
    if not bad.any():
        return
    nan = int(np.count_nonzero(np.isnan(values)))
    posinf = int(np.count_nonzero(values == np.inf))
    found.nan += nan
    found.posinf += posinf
    found.neginf += int(np.count_nonzero(bad)) - nan - posinf
    if found.first < 0:
        found.first = first_index + int(np.argmax(bad))


# -- two tensors' values -------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    """What comparing two tensors' values found so far: elements not equal, the largest |a - b| over elements where
    both are finite and the flat index of its first occurrence (-1: no such element differs), and the sums of
    squares of a - b and of a over those elements."""

    differ: int = 0
    max_abs: float = 0.0
    where: int = -1
    diff_squares: float = 0.0
    norm_squares: float = 0.0
    # elements not equal for a NaN or an infinity (whatever the tolerances): NaN on one side only, ±inf against a
    # finite value on one side, +inf against -inf
    nan_only_a: int = 0
    nan_only_b: int = 0
    inf_only_a: int = 0
    inf_only_b: int = 0
    inf_opposite: int = 0

    @property
    def nonfinite(self) -> dict[str, int]:
        """The counts of the elements that differ for a NaN or an infinity, by kind."""
        return {
            "nan_only_a": self.nan_only_a,
            "nan_only_b": self.nan_only_b,
            "inf_only_a": self.inf_only_a,
            "inf_only_b": self.inf_only_b,
            "inf_opposite": self.inf_opposite,
        }

    @property
    def rel_l2(self) -> float | None:
        """‖a - b‖₂ / ‖a‖₂ (``None`` where it has no finite value: a is all zeros and b is not)."""
        if self.diff_squares == 0.0:
            return 0.0
        ratio = math.sqrt(self.diff_squares) / math.sqrt(self.norm_squares) if self.norm_squares else math.inf
        return ratio if math.isfinite(ratio) else None


def compare_values(a: np.ndarray, b: np.ndarray, first_index: int, atol: float, rtol: float, tally: Tally) -> None:
    """Add the comparison of the float64 values ``a`` and ``b`` (from flat index ``first_index``) to ``tally``.

    Equal: ``|a - b| <= atol + rtol * |b|`` (``numpy.isclose``), both NaN, or the same infinity."""
    with np.errstate(invalid="ignore", over="ignore"):
        if atol == 0.0 and rtol == 0.0:
            unequal = a != b
            unequal &= ~(np.isnan(a) & np.isnan(b))
            tally.differ += int(np.count_nonzero(unequal))
        else:
            tally.differ += len(a) - int(np.count_nonzero(np.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)))
        finite = np.isfinite(a) & np.isfinite(b)
        gaps = np.abs(a - b)
        if not finite.all():
            _count_nonfinite(a, b, tally)
            gaps[~finite] = 0.0
            a = np.where(finite, a, 0.0)
        largest = int(np.argmax(gaps)) if len(gaps) else 0
        if len(gaps) and gaps[largest] > tally.max_abs:
            tally.max_abs, tally.where = float(gaps[largest]), first_index + largest
        tally.diff_squares += _squares(gaps)
        tally.norm_squares += _squares(a)


def _count_nonfinite(a: np.ndarray, b: np.ndarray, tally: Tally) -> None:
    """Add the elements where a NaN or an infinity makes ``a`` and ``b`` differ to ``tally``, by kind."""
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    inf_a, inf_b = np.isinf(a), np.isinf(b)
    tally.nan_only_a += int(np.count_nonzero(nan_a & ~nan_b))
    tally.nan_only_b += int(np.count_nonzero(nan_b & ~nan_a))
    tally.inf_only_a += int(np.count_nonzero(inf_a & np.isfinite(b)))
    tally.inf_only_b += int(np.count_nonzero(inf_b & np.isfinite(a)))
    tally.inf_opposite += int(np.count_nonzero(inf_a & inf_b & (a != b)))


def add_norm(a: np.ndarray, tally: Tally) -> None:
    """Add values equal on both sides to ``tally``: only ‖a‖₂ grows (over the finite ones)."""
    finite = np.isfinite(a)
    if not finite.all():
        a = a[finite]
    with np.errstate(over="ignore"):
        tally.norm_squares += _squares(a)


def _squares(values: np.ndarray) -> float:
    """The sum of the squares of ``values``: einsum's own loop, not BLAS's (np.dot), whose threads, woken for every
    call, cost ten times the sum on two busy cores."""
    return float(np.einsum("i,i->", values, values))


def count_unequal_elements(a: np.ndarray, b: np.ndarray, element_bytes: int) -> int:
    """Elements of ``element_bytes`` bytes whose bytes differ between the ``uint8`` chunks ``a`` and ``b``."""
    unequal = a != b
    return int(np.count_nonzero(unequal.reshape(-1, element_bytes).any(axis=1)))
