"""``stats/PATH.json``: counts, extremes, moments and a 64-bin histogram of a tensor's values as float64.

The numbers are NumPy's on the float64 values (``numpy.histogram``'s bins: 64 equal ones from min to max,
the last closed; one bin ``[min, max]`` when they are equal), computed in chunks of ``chunks.PIECE_VALUES``:

* dtypes of at most 16 bits (``decode.CODED``: BOOL, 8-bit integers, F8, F6, F4, 16-bit integers, F16,
  BF16): one pass counting each code (``np.bincount``); every number then follows from the counts of at
  most 65,536 distinct values, the sums exactly (``math.fsum``);
* the others (32- and 64-bit integers, F32, F64): a first pass for the counts and extremes, a second for
  the histogram and the moments (Chan's pairwise combination of each chunk's mean and squared deviations,
  scaled by a power of two near ``abs_max`` where float64 could overflow or underflow).

The file has a fixed size known from the header (``stats_size``): the document, then spaces up to the
size of the longest one a tensor of its dtype and shape can have, then a newline.
"""

from __future__ import annotations

import json
import math
from functools import cache

import numpy as np

from .chunks import PIECE_VALUES, TensorBytes
from .decode import CODED, code_values, codes, to_float64
from .formats import TensorEntry

BINS = 64
INTEGERS = frozenset({"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"})
_LONGEST_FLOAT = -2.2250738585072014e-308  # 24 characters: no float64's repr is longer
Document = dict[str, object]


def stats_size(entry: TensorEntry) -> int:
    """The size of ``entry``'s ``stats/`` file, from its dtype and shape alone."""
    return len(_head(entry.dtype, entry.shape)) + _tail_size(len(str(math.prod(entry.shape))))


def stats_file(tensor: TensorBytes, size: int) -> bytes:
    """The ``stats/`` file of ``tensor``: its document padded with spaces to ``size`` bytes and a newline."""
    text = render(summarize(tensor))
    if len(text) >= size:
        raise RuntimeError(f"{tensor.key}: a stats document of {len(text)} bytes for a file of {size}")
    return text + b" " * (size - len(text) - 1) + b"\n"


def render(document: Document) -> bytes:
    """One member a line, arrays on theirs: ``grep -l '"nan": [1-9]'`` finds the tensors holding a NaN."""
    lines = (f"  {json.dumps(key)}: {json.dumps(value, allow_nan=False)}" for key, value in document.items())
    return ("{\n" + ",\n".join(lines) + "\n}").encode()


def summarize(tensor: TensorBytes) -> Document:
    """The statistics of ``tensor``'s values, in the order the file lists them."""
    head: Document = {"dtype": tensor.dtype, "shape": list(tensor.shape)}
    return head | (_by_codes(tensor) if tensor.dtype in CODED else _by_passes(tensor))


def _by_codes(tensor: TensorBytes) -> Document:
    """One pass: how many times each code occurs."""
    dtype = tensor.dtype
    values = code_values(dtype)
    counts = np.zeros(len(values), dtype=np.int64)
    for _, raw in tensor.pieces():
        counts += np.bincount(codes(dtype, raw), minlength=len(values))
    present = counts > 0
    values, counts = values[present], counts[present]
    finite = np.isfinite(values)
    found = _counts(
        count=int(counts.sum()),
        finite=int(counts[finite].sum()),
        nan=int(counts[np.isnan(values)].sum()),
        posinf=int(counts[values == np.inf].sum()),
        zeros=int(counts[values == 0].sum()),
    )
    values, counts = values[finite], counts[finite]
    if not len(values):
        return found | _nothing_finite()
    total = int(counts.sum())
    mean = math.fsum(values * counts) / total  # each product exact: at most 16 significant bits times a count
    std = math.sqrt(math.fsum(counts * (values - mean) ** 2) / total)
    low, high = float(values.min()), float(values.max())
    bins = _binned(values, low, high, counts) if low < high else counts
    return found | _numbers(low, high, mean, std, bins)


def _by_passes(tensor: TensorBytes) -> Document:
    """Two passes: counts and extremes, then the histogram (its edges need the extremes) and the moments."""
    dtype = tensor.dtype
    out = np.empty(PIECE_VALUES, dtype=np.float64)
    count = finite = nan = posinf = zeros = 0
    low, high = math.inf, -math.inf
    for _, raw in tensor.pieces():
        x = to_float64(dtype, raw, out)
        count += len(x)
        zeros += len(x) - int(np.count_nonzero(x))  # NaN is not zero
        if dtype not in INTEGERS:
            good = np.isfinite(x)
            if not good.all():
                nan += int(np.count_nonzero(np.isnan(x)))
                posinf += int(np.count_nonzero(x == np.inf))
                x = x[good]
        finite += len(x)
        if len(x):
            low, high = min(low, float(x.min())), max(high, float(x.max()))
    found = _counts(count=count, finite=finite, nan=nan, posinf=posinf, zeros=zeros)
    if not finite:
        return found | _nothing_finite()
    # the moments of x * scale, a power of two bringing abs_max near 1 where float64 could over- or underflow
    exponent = math.frexp(max(-low, high))[1]
    scale = math.ldexp(1.0, -exponent) if abs(exponent) > 400 else 1.0
    seen, mean, squares = 0, 0.0, 0.0
    bins = np.zeros(BINS if low < high else 1, dtype=np.int64)
    for _, raw in tensor.pieces():
        x = to_float64(dtype, raw, out)
        if dtype not in INTEGERS:
            x = x[np.isfinite(x)]
        if not len(x):
            continue
        if low < high:
            bins += _binned(x, low, high)
        if scale != 1.0:
            x = x * scale
        part = float(x.mean())
        deviations = x - part
        part_squares = float(np.square(deviations, out=deviations).sum())  # pairwise sum; BLAS's dot: 25x slower
        total = seen + len(x)
        delta = part - mean  # Chan, Golub and LeVeque: two parts' means and sums of squared deviations combined
        mean += delta * len(x) / total
        squares += part_squares + delta * delta * seen * len(x) / total
        seen = total
    if low == high:
        bins[0] = finite
    return found | _numbers(low, high, mean / scale, math.sqrt(squares / seen) / scale, bins)


def _counts(count: int, finite: int, nan: int, posinf: int, zeros: int) -> Document:
    neginf = count - finite - nan - posinf
    return {"count": count, "finite": finite, "nan": nan, "posinf": posinf, "neginf": neginf, "zeros": zeros}


def _binned(values: np.ndarray, low: float, high: float, weights: np.ndarray | None = None) -> np.ndarray:
    """``numpy.histogram``'s 64 counts from ``low`` to ``high`` (of values halved, exactly, where ``high - low``
    overflows float64: NumPy cannot bin that range itself)."""
    if _halved(low, high):
        values, low, high = values * 0.5, low * 0.5, high * 0.5
    return np.histogram(values, bins=BINS, range=(low, high), weights=weights)[0].astype(np.int64)


def _halved(low: float, high: float) -> bool:
    return not math.isfinite(high - low)


def _numbers(low: float, high: float, mean: float, std: float, bins: np.ndarray) -> Document:
    """The numbers over the finite values; ``bins``: the 64 counts (``numpy.histogram``'s edges from ``low`` to
    ``high``), or one when ``low == high``, holding them all. Zeros are written 0.0 whatever their sign: ``x + 0.0``
    turns -0.0 into 0.0 and leaves every other float as it is (``max(-0.0, 0.0)`` is -0.0, the first of equals)."""
    low, high, mean, std = low + 0.0, high + 0.0, mean + 0.0, std + 0.0
    if low == high:
        histogram = {"edges": [low, high], "counts": [int(bins.sum())]}
    else:
        scale = 2.0 if _halved(low, high) else 1.0
        edges = np.linspace(low / scale, high / scale, BINS + 1) * scale + 0.0
        histogram = {"edges": edges.tolist(), "counts": [int(n) for n in bins]}
    return {"min": low, "max": high, "mean": mean, "std": std, "abs_max": max(-low, high) + 0.0, "histogram": histogram}


def _nothing_finite() -> Document:
    return {"min": None, "max": None, "mean": None, "std": None, "abs_max": None, "histogram": None}


def _head(dtype: str, shape: tuple[int, ...]) -> bytes:
    return render({"dtype": dtype, "shape": list(shape)})[:-2]  # less the closing "\n}"


@cache
def _tail_size(digits: int) -> int:
    """Bytes after ``_head`` of the longest document whose counts have ``digits`` digits, and the newline."""
    number, value = 10**digits - 1, _LONGEST_FLOAT
    longest = _counts(number, number, number, number, number) | {"neginf": number}
    longest |= {name: value for name in ("min", "max", "mean", "std", "abs_max")}
    longest["histogram"] = {"edges": [value] * (BINS + 1), "counts": [number] * BINS}
    return len(render({"dtype": "", "shape": []} | longest)) - len(_head("", ())) + 1
