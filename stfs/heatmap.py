"""``png/PATH.png``: a tensor as a heatmap, averaged down to at most 1024 x 1024 pixels (SPEC §9).

The tensor is R rows x C columns (R = ``shape[0]``, C the product of the others; 1-D: one row; 0-D: 1 x 1).
Pixel (i, j) is the mean of the finite values of rows ``i*R//h .. (i+1)*R//h - 1`` and columns
``j*C//w .. (j+1)*C//w - 1`` (``h = min(R, 1024)``, ``w = min(C, 1024)``), summed in float64 in one pass
over the tensor in chunks. The colour scale m is what the picture shows, not the tensor's largest value (one
outlier would wash everything else out): the 99th percentile of |v| over the pixels v that have a finite value,
by nearest rank (the k-th smallest, k = ceil(0.99 n)), or the largest |v| where that is 0 (a sparse tensor).
With t = min(255, round(255 |v| / m)) (half to even, as ``numpy.rint``): red (255, 255-t, 255-t) for v > 0,
blue (255-t, 255-t, 255) for v < 0, white for v = 0 or m = 0, black where no value is finite.

The PNG is 8-bit RGB, unfiltered, in one IDAT chunk compressed by the standard library's zlib at level 0
(stored blocks): the length of a stored deflate stream depends on the length of its input only, never on
the bytes. Two tEXt chunks say which scale was used: ``stfs.scale`` (``p99 of |pixel|`` or ``max of |pixel|``,
one length) and ``stfs.scale.value`` (m's ``repr``, padded with spaces to the longest a float64's can be). So
the file's size follows from the shape (``png_size``, measured once per image size on zeros).
"""

from __future__ import annotations

import math
import struct
import zlib
from functools import cache

import numpy as np

from .chunks import PIECE_VALUES, TensorBytes
from .decode import is_float, to_float64
from .formats import TensorEntry

MAX_SIDE = 1024
INTEGERS = frozenset({"U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"})
_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PERCENTILE = "p99 of |pixel|"
LARGEST = "max of |pixel|"  # where the percentile is 0: as long as PERCENTILE, so the file's size does not change
_VALUE_WIDTH = 24  # characters: no positive float64's repr is longer (2.2250738585072014e-308 has 23)


def has_heatmap(entry: TensorEntry) -> bool:
    """Whether ``entry`` gets a ``png/`` file: a float or integer dtype and at least one element."""
    return (entry.dtype in INTEGERS or is_float(entry.dtype)) and math.prod(entry.shape) > 0


def grid(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(R, C, h, w): the tensor's rows and columns, and the image's."""
    rows = shape[0] if len(shape) > 1 else 1
    columns = math.prod(shape[1:]) if len(shape) > 1 else math.prod(shape)
    return rows, columns, min(rows, MAX_SIDE), min(columns, MAX_SIDE)


def png_size(shape: tuple[int, ...]) -> int:
    """The size of the ``png/`` file of a tensor of ``shape``, from the shape alone."""
    _, _, height, width = grid(shape)
    return _png_size(height, width)


@cache
def _png_size(height: int, width: int) -> int:
    return len(encode(np.zeros((height, width, 3), dtype=np.uint8), PERCENTILE, 0.0))


def encode(rgb: np.ndarray, scale: str, m: float) -> bytes:
    """A PNG of ``rgb`` (height x width x 3, uint8): filter type 0 on every row, deflate stored blocks; its tEXt
    chunks name the colour scale ``scale`` and its value ``m``, in a fixed number of bytes."""
    height, width, _ = rgb.shape
    scanlines = np.zeros((height, 1 + 3 * width), dtype=np.uint8)  # each row: its filter byte (0), then RGB
    scanlines[:, 1:] = rgb.reshape(height, 3 * width)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, deflate, no interlace
    value = repr(m)
    if len(scale) != len(PERCENTILE) or len(value) > _VALUE_WIDTH:
        raise ValueError(f"a heatmap scale of another length: {scale!r} = {value}")
    return b"".join(
        (
            _SIGNATURE,
            _chunk(b"IHDR", header),
            _chunk(b"tEXt", b"stfs.scale\0" + scale.encode("latin-1")),
            _chunk(b"tEXt", b"stfs.scale.value\0" + value.ljust(_VALUE_WIDTH).encode("latin-1")),
            _chunk(b"IDAT", zlib.compress(scanlines.data, 0)),
            _chunk(b"IEND", b""),
        )
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def heatmap_file(tensor: TensorBytes, size: int) -> bytes:
    """The ``png/`` file of ``tensor`` (``size``: what ``png_size`` promised; checked by the caller)."""
    with np.errstate(over="ignore", invalid="ignore"):
        sums, finite, abs_max = pixel_sums(tensor)
    factor = 1.0
    if not np.isfinite(sums[finite > 0]).all():  # float64 overflowed (F64 values past 1e300): sum scaled instead
        factor = math.ldexp(1.0, -math.frexp(abs_max)[1])
        sums, finite, abs_max = pixel_sums(tensor, scale=factor)
    means = pixel_means(sums, finite)
    scale, m = colour_scale(means[finite > 0])
    return encode(colours(means, finite, m), scale, m / factor)  # m / factor: exact, a power of two


def pixel_sums(tensor: TensorBytes, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray, float]:
    """(sum of the finite values of each pixel (times ``scale``), their count, abs_max of the tensor (times
    ``scale``)), in one pass."""
    rows, columns, height, width = grid(tensor.shape)
    cells = Cells(rows, columns, height, width)
    sums = np.zeros((height, width))
    bad: np.ndarray | None = None  # values that are not finite, by pixel: only once one is met
    out = np.empty(PIECE_VALUES, dtype=np.float64)
    abs_max = 0.0
    for first, raw in tensor.pieces():
        x = to_float64(tensor.dtype, raw, out)
        if tensor.dtype not in INTEGERS:
            good = np.isfinite(x)
            if not good.all():
                if bad is None:
                    bad = np.zeros((height, width))
                cells.add(bad, first, (~good).astype(np.float64))
                x[~good] = 0.0
        if scale != 1.0:
            x *= scale
        abs_max = max(abs_max, float(x.max()), -float(x.min()))
        cells.add(sums, first, x)
    finite = cells.sizes()
    if bad is not None:
        finite -= bad
    return sums, finite, abs_max


def pixel_means(sums: np.ndarray, finite: np.ndarray) -> np.ndarray:
    """Each pixel's mean of its finite values (0 where it has none)."""
    return np.divide(sums, finite, out=np.zeros_like(sums), where=finite > 0)


def colour_scale(pixels: np.ndarray) -> tuple[str, float]:
    """(Which scale, m) for the means ``pixels`` of the pixels that have a finite value: the 99th percentile of
    their magnitudes by nearest rank (the k-th smallest, k = ceil(0.99 n)), or their largest where only that is
    not 0; m = 0 (all white) where every pixel is 0 or none has a finite value."""
    if not len(pixels):
        return PERCENTILE, 0.0
    magnitudes = np.abs(pixels)
    rank = (99 * len(magnitudes) + 99) // 100  # ceil(0.99 n), in integers
    m = float(np.partition(magnitudes, rank - 1)[rank - 1])
    largest = float(magnitudes.max())
    return (PERCENTILE, m) if m > 0 or largest == 0 else (LARGEST, largest)


def colours(means: np.ndarray, finite: np.ndarray, m: float) -> np.ndarray:
    """The RGB pixels of each pixel's mean against the scale ``m`` (``finite``: each pixel's count of finite
    values); magnitudes past ``m`` are full colour."""
    has = finite > 0
    shade = np.zeros(means.shape, dtype=np.uint8)  # t
    if m > 0:
        shade[...] = np.minimum(np.rint(np.abs(means) / m * 255), 255)
    rgb = np.full((*means.shape, 3), 255, dtype=np.uint8)
    positive, negative = has & (means > 0), has & (means < 0)
    rgb[positive, 1] = rgb[positive, 2] = 255 - shade[positive]
    rgb[negative, 0] = rgb[negative, 1] = 255 - shade[negative]
    rgb[~has] = 0
    return rgb


class Cells:
    """Adds values given in C order (a chunk: the index of its first value, the values) into their pixels."""

    def __init__(self, rows: int, columns: int, height: int, width: int) -> None:
        self.columns = columns
        self.row_starts = np.arange(height + 1, dtype=np.int64) * rows // height  # pixel i: rows [i], [i + 1] - 1
        self.column_starts = np.arange(width + 1, dtype=np.int64) * columns // width
        self.one_row_each = height == rows
        self.one_column_each = width == columns

    def sizes(self) -> np.ndarray:
        """The number of values of each pixel, as float64."""
        heights = np.diff(self.row_starts).astype(np.float64)
        return np.outer(heights, np.diff(self.column_starts).astype(np.float64))

    def add(self, target: np.ndarray, first: int, values: np.ndarray) -> None:
        """Add ``values``, the tensor's from value ``first`` on, to ``target`` (height x width), pixel by pixel."""
        columns = self.columns
        done = 0
        while done < len(values):
            row, column = divmod(first + done, columns)
            if column or len(values) - done < columns:  # a piece of one row
                count = min(columns - column, len(values) - done)
                self._add_piece(target, row, column, values[done : done + count])
            else:  # whole rows
                count = (len(values) - done) // columns * columns
                self._add_rows(target, row, values[done : done + count].reshape(-1, columns))
            done += count

    def _add_rows(self, target: np.ndarray, row: int, block: np.ndarray) -> None:
        if self.one_row_each:
            first, sums = row, block
        else:  # sum the rows of each pixel row first: whole contiguous rows added, the cheap direction
            starts = self.row_starts
            first = int(np.searchsorted(starts, row, side="right")) - 1
            last = int(np.searchsorted(starts, row + len(block) - 1, side="right")) - 1
            sums = np.empty((last - first + 1, block.shape[1]))
            for index, pixel in enumerate(range(first, last + 1)):
                low, high = max(int(starts[pixel]), row) - row, min(int(starts[pixel + 1]), row + len(block)) - row
                np.sum(block[low:high], axis=0, out=sums[index])
        if not self.one_column_each:
            sums = np.add.reduceat(sums, self.column_starts[:-1], axis=1)
        target[first : first + len(sums)] += sums

    def _add_piece(self, target: np.ndarray, row: int, column: int, piece: np.ndarray) -> None:
        pixel_row = int(np.searchsorted(self.row_starts, row, side="right")) - 1
        if self.one_column_each:
            target[pixel_row, column : column + len(piece)] += piece
            return
        starts = self.column_starts
        first = int(np.searchsorted(starts, column, side="right")) - 1
        last = int(np.searchsorted(starts, column + len(piece) - 1, side="right")) - 1
        offsets = np.maximum(starts[first : last + 1] - column, 0)
        target[pixel_row, first : last + 1] += np.add.reduceat(piece, offsets)
