"""``--view stats`` and ``--view png`` (SPEC §9), really mounted: every dtype's statistics against NumPy's on the
float64 values, the pixel rule against an independent reference, PIL opening every PNG, sizes known before any
read and equal to the bytes read, and no tensor read for ``stat`` (the daemon's reads locally, nginx's log
remotely)."""

from __future__ import annotations

import errno
import io
import json
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from PIL import Image

from stfs.chunks import TensorBytes
from stfs.daemon import daemon_pid, mounted
from stfs.decode import NATIVE
from stfs.formats.dtypes import DTYPE_BITS
from stfs.formats.safetensors import TensorEntry
from stfs.heatmap import png_size
from stfs.summary import Finished
from stfs.tensor_stats import render, stats_size
from tests.decoding import every_code, reference
from tests.helpers import MountFn, dd_whole, need_fuse, peak_rss_anon_while, read_cold, rss_anon, run
from tests.models import FLOAT_DTYPES, Tensors, read_tensors, write_by_hand, write_serialized, write_sharded
from tests.servers import FaultProxy, Nginx

pytestmark = pytest.mark.timeout(120)

FLOATS = FLOAT_DTYPES
INTEGERS = {"U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"}
STATS_DTYPES = sorted(set(DTYPE_BITS) - {"C64"})


def values_of(dtype: str, data: bytes) -> np.ndarray:
    """The tensor's values as float64, decoded independently of stfs (tests/decoding.py)."""
    with np.errstate(invalid="ignore"):  # NaN codes
        if dtype in NATIVE:
            return np.frombuffer(data, dtype=NATIVE[dtype]).astype(np.float64)
        return reference(data, dtype).astype(np.float64)


def sample(dtype: str, count: int, seed: int) -> bytes:
    """Random codes (NaN and inf codes among them) for the float dtypes; whole ranges for the integers."""
    rng = np.random.default_rng(seed)
    if dtype == "BOOL":
        return rng.integers(0, 2, count).astype(bool).tobytes()
    if dtype == "F64":  # random bits would overflow NumPy's own sums: normal values, a few special ones
        values = rng.standard_normal(count) * 1e3
        values[:4] = [np.nan, np.inf, -np.inf, 0.0]
        return values.tobytes()
    return every_code(dtype, count, seed)


def write_models(folder: Path) -> None:
    """Two models in one folder: every dtype but F6 by safetensors, F6 by hand; the special tensors too."""
    folder.mkdir()
    tensors: Tensors = {}
    for seed, dtype in enumerate(sorted(set(DTYPE_BITS) - {"F6_E2M3", "F6_E3M2"})):
        tensors[f"every.{dtype.lower()}"] = (dtype, [48, 100], sample(dtype, 4800, seed))
    rng = np.random.default_rng(99)
    wide = rng.standard_normal((1100, 1300)).astype(np.float32)
    wide[rng.integers(0, 1100, 500), rng.integers(0, 1300, 500)] = np.nan
    wide[:3, :] = np.nan  # whole pixels with nothing finite: black
    tall = rng.integers(-1000, 1000, (3000, 2), dtype=np.int32)
    long = rng.standard_normal(2_400_002).astype(np.float16)
    long[rng.integers(0, len(long), 100)] = np.inf
    tensors |= {
        "special.empty": ("F32", [0, 3], b""),
        "special.empty_bf16": ("BF16", [4, 0], b""),
        "special.scalar": ("BF16", [], np.array([-2.5], dtype=ml_dtypes.bfloat16).tobytes()),
        "special.constant": ("F16", [5, 5], np.full(25, 2.5, dtype=np.float16).tobytes()),
        "special.constant_i64": ("I64", [7], np.full(7, -3, dtype=np.int64).tobytes()),
        "special.zeros": ("F32", [2, 3], np.zeros(6, dtype=np.float32).tobytes()),
        "special.nan": ("F32", [4, 4], np.full(16, np.nan, dtype=np.float32).tobytes()),
        "special.nan_bf16": ("BF16", [3], np.full(3, np.nan, dtype=ml_dtypes.bfloat16).tobytes()),
        "special.normal_f32": ("F32", [300, 7], rng.standard_normal(2100).astype(np.float32).tobytes()),
        "special.huge_f64": ("F64", [50], (rng.standard_normal(50) * 1e305).tobytes()),
        "special.tiny_f64": ("F64", [50], (rng.standard_normal(50) * 1e-305).tobytes()),
        "special.extreme_f64": ("F64", [2, 3], np.array([-1.7e308, 1.7e308, 0, 1, 1e308, np.nan]).tobytes()),
        "special.overflow_f64": ("F64", [1, 2048], np.full(2048, -1.5e308).tobytes()),
        "special.cube": ("F16", [5, 7, 300], rng.standard_normal(10500).astype(np.float16).tobytes()),
        "special.wide": ("F32", [1100, 1300], wide.tobytes()),
        "special.tall": ("I32", [3000, 2], tall.tobytes()),
        "special.line": ("BF16", [5000], rng.standard_normal(5000).astype(ml_dtypes.bfloat16).tobytes()),
        "special.long": ("F16", [1_200_001 * 2], long.tobytes()),  # one row over several chunks
    }
    write_serialized(folder / "packed.safetensors", tensors)
    write_by_hand(
        folder / "hand.safetensors",
        {
            "every.f6_e2m3": ("F6_E2M3", [48, 100], every_code("F6_E2M3", 4800, seed=7)),
            "every.f6_e3m2": ("F6_E3M2", [4000], every_code("F6_E3M2", 4000, seed=8)),
        },
    )


@dataclass
class Tensor:
    model: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @property
    def values(self) -> np.ndarray:
        return values_of(self.dtype, self.data)

    def path(self, root: str, view: str) -> str:
        return os.path.join(
            root, self.model, view, self.name.replace(".", "/") + "." + ("json" if view == "stats" else "png")
        )


def catalog(source: Path, model: str) -> list[Tensor]:
    """Every tensor of a safetensors file, read straight from it."""
    return [Tensor(model, name, dtype, shape, data) for name, dtype, shape, data, _ in read_tensors(source)]


@dataclass
class Mounted:
    root: str
    tensors: list[Tensor]

    def named(self, name: str) -> Tensor:
        return next(tensor for tensor in self.tensors if tensor.name == name)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("inspect") / "models"
    write_models(folder)
    return folder


@pytest.fixture(scope="module")
def inspected(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mounted]:
    """Both models mounted once with ``-o view=stats,view=png``."""
    need_fuse()
    tensors = [t for name in ("packed", "hand") for t in catalog(models / f"{name}.safetensors", name)]
    assert {tensor.dtype for tensor in tensors} == set(DTYPE_BITS)
    with mounted(str(models), str(tmp_path_factory.mktemp("mnt")), options=["view=stats,view=png"]) as root:
        yield Mounted(root, tensors)


# -- the statistics ----------------------------------------------------------------------------------------------


def expected_stats(tensor: Tensor) -> dict[str, object]:
    """What SPEC §9 says the file holds, by NumPy on the float64 values."""
    values = tensor.values
    finite = values[np.isfinite(values)]
    found: dict[str, object] = {
        "dtype": tensor.dtype,
        "shape": list(tensor.shape),
        "count": len(values),
        "finite": len(finite),
        "nan": int(np.isnan(values).sum()),
        "posinf": int((values == np.inf).sum()),
        "neginf": int((values == -np.inf).sum()),
        "zeros": int((values == 0).sum()),
    }
    if not len(finite):
        return found | dict.fromkeys(("min", "max", "mean", "std", "abs_max", "histogram"))
    low, high = float(finite.min()), float(finite.max())
    if low == high:
        histogram = {"edges": [low, high], "counts": [len(finite)]}
    elif math.isfinite(high - low):
        counts, edges = np.histogram(finite, bins=64)
        histogram = {"edges": edges.tolist(), "counts": counts.tolist()}
    else:  # NumPy cannot make bins of a range past float64's: those of the values halved, edges doubled
        counts, edges = np.histogram(finite / 2, bins=64)
        histogram = {"edges": (edges * 2).tolist(), "counts": counts.tolist()}
    abs_max = float(np.abs(finite).max())
    if abs_max == 0 or 2.0**-400 <= abs_max <= 2.0**400:
        mean, std = float(np.mean(finite)), float(np.std(finite))
    else:  # NumPy's own sums of squares of 1e305s overflow, of 1e-305s underflow: NumPy's on the values scaled
        mean, std = float(np.mean(finite / abs_max)) * abs_max, float(np.std(finite / abs_max)) * abs_max
    return found | {
        "min": low,
        "max": high,
        "mean": mean,
        "std": std,
        "abs_max": abs_max,
        "histogram": histogram,
    }


def check_stats(path: str, tensor: Tensor) -> None:
    size = os.stat(path).st_size  # known before the first read
    with open(path, "rb") as stream:
        content = stream.read()
    assert len(content) == size, path
    assert content.endswith(b"\n")
    got = json.loads(content)
    expected = expected_stats(tensor)
    assert list(got) == list(expected), path
    for key in ("mean", "std"):
        if expected[key] is None:
            assert got[key] is None
        else:
            assert abs(got[key] - expected[key]) <= 1e-9 * expected["abs_max"], (path, key, got[key], expected[key])
    for key in expected:
        if key not in ("mean", "std"):
            assert got[key] == expected[key], (path, key)
    if got["histogram"] is not None:
        assert sum(got["histogram"]["counts"]) == got["finite"]


@pytest.mark.parametrize("dtype", STATS_DTYPES)
def test_stats_of_every_dtype_are_numpys(inspected: Mounted, dtype: str) -> None:
    for tensor in inspected.tensors:
        if tensor.dtype == dtype:
            check_stats(tensor.path(inspected.root, "stats"), tensor)


@pytest.mark.parametrize(
    "name",
    [
        "special.empty",
        "special.empty_bf16",
        "special.scalar",
        "special.constant",
        "special.constant_i64",
        "special.zeros",
        "special.nan",
        "special.nan_bf16",
        "special.normal_f32",
        "special.huge_f64",
        "special.tiny_f64",
        "special.extreme_f64",
        "special.overflow_f64",
        "special.wide",
        "special.tall",
        "special.long",
    ],
)
def test_stats_of_special_tensors(inspected: Mounted, name: str) -> None:
    tensor = inspected.named(name)
    check_stats(tensor.path(inspected.root, "stats"), tensor)


def test_the_special_cases_read_as_the_spec_says(inspected: Mounted) -> None:
    def stats(name: str) -> dict:
        with open(inspected.named(name).path(inspected.root, "stats")) as stream:
            return json.load(stream)

    empty, nan, constant, scalar = (
        stats("special.empty"),
        stats("special.nan"),
        stats("special.constant"),
        stats("special.scalar"),
    )
    assert empty["count"] == 0 and empty["min"] is None and empty["histogram"] is None
    assert nan["nan"] == 16 and nan["finite"] == 0 and nan["abs_max"] is None and nan["histogram"] is None
    assert constant["histogram"] == {"edges": [2.5, 2.5], "counts": [25]} and constant["std"] == 0.0
    assert scalar["count"] == 1 and scalar["min"] == scalar["max"] == scalar["mean"] == -2.5
    assert scalar["abs_max"] == 2.5


def test_no_stats_for_c64(inspected: Mounted) -> None:
    complex_tensor = next(t for t in inspected.tensors if t.dtype == "C64")
    assert not os.path.exists(complex_tensor.path(inspected.root, "stats"))
    assert os.path.exists(complex_tensor.path(inspected.root, "stats").replace("c64.json", "f32.json"))


@pytest.mark.parametrize("dtype", ["F32", "F64", "F16", "BF16"])  # two passes (F32, F64), one count of codes
def test_zeros_of_either_sign_are_written_0(tmp_path: Path, mount: MountFn, dtype: str) -> None:
    """An all-zero tensor's abs_max, and min, max, mean, std and edges of tensors of -0.0 only or of both signs, are
    0.0: never -0.0, whatever the sign of the zeros."""
    source = tmp_path / "zeros.safetensors"
    numpy_dtype = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "BF16": ml_dtypes.bfloat16}[dtype]
    tensors = {
        "plus": np.zeros(6, dtype=numpy_dtype),
        "minus": np.full(6, -0.0, dtype=numpy_dtype),
        "both": np.array([-0.0, 0.0, -0.0, 0.0], dtype=numpy_dtype),
    }
    write_serialized(source, {name: (dtype, list(a.shape), a.tobytes()) for name, a in tensors.items()})
    root = mount(str(source), options=["view=stats"])
    for name, values in tensors.items():
        with open(os.path.join(root, "stats", f"{name}.json")) as stream:
            text = stream.read()
        document = json.loads(text)
        assert "-0" not in text, (name, text)
        numbers = [document[key] for key in ("min", "max", "mean", "std", "abs_max")] + document["histogram"]["edges"]
        assert all(number == 0.0 and math.copysign(1.0, number) == 1.0 for number in numbers), (name, numbers)
        assert document["zeros"] == document["count"] == len(values)


def test_grep_and_jq_find_the_tensors_holding_a_nan(inspected: Mounted) -> None:
    stats = Path(inspected.root, "packed", "stats")
    holding = {
        t.name for t in inspected.tensors if t.model == "packed" and t.dtype != "C64" and np.isnan(t.values).any()
    }
    grep = run(["grep", "-rlE", '"nan": [1-9]', str(stats)])
    assert grep.returncode == 0, grep.stderr
    found = {os.path.relpath(line, stats).removesuffix(".json").replace("/", ".") for line in grep.stdout.split()}
    assert found == holding
    files = sorted(str(path) for path in stats.rglob("*.json"))
    jq = run(["jq", "-r", "select(.nan > 0) | input_filename", *files]) if _has("jq") else None
    if jq is not None:
        assert jq.returncode == 0, jq.stderr
        assert {
            os.path.relpath(line, stats).removesuffix(".json").replace("/", ".") for line in jq.stdout.split()
        } == holding


def _has(tool: str) -> bool:
    import shutil

    return shutil.which(tool) is not None


# -- the heatmaps ------------------------------------------------------------------------------------------------


def expected_pixels(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """SPEC §9's pixel rule, by ``np.add.at`` over each value's pixel (not stfs's row and column sums)."""
    rows = shape[0] if len(shape) > 1 else 1
    columns = math.prod(shape[1:]) if len(shape) > 1 else math.prod(shape)
    height, width = min(rows, 1024), min(columns, 1024)
    grid = values.reshape(rows, columns)
    row_pixel = np.searchsorted(np.arange(height + 1) * rows // height, np.arange(rows), side="right") - 1
    column_pixel = np.searchsorted(np.arange(width + 1) * columns // width, np.arange(columns), side="right") - 1
    finite = np.isfinite(grid)
    abs_max = float(np.abs(grid[finite]).max()) if finite.any() else 0.0
    if abs_max > 1e300:  # sums past float64's range: those of the values over abs_max (m scales with them)
        grid = grid / abs_max
    i, j = np.broadcast_arrays(row_pixel[:, None], column_pixel[None, :])
    sums, counts = np.zeros((height, width)), np.zeros((height, width))
    np.add.at(sums, (i[finite], j[finite]), grid[finite])
    np.add.at(counts, (i[finite], j[finite]), 1)
    means = np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)
    m = scale_of(means[counts > 0])
    t = np.minimum(np.rint(np.abs(means) / m * 255), 255).astype(np.uint8) if m > 0 else np.zeros(means.shape, np.uint8)
    rgb = np.full((height, width, 3), 255, dtype=np.uint8)
    positive, negative = (counts > 0) & (means > 0), (counts > 0) & (means < 0)
    rgb[positive, 1] = rgb[positive, 2] = 255 - t[positive]
    rgb[negative, 0] = rgb[negative, 1] = 255 - t[negative]
    rgb[counts == 0] = 0
    return rgb


def scale_of(pixels: np.ndarray) -> float:
    """m (docs/views.md): the 99th percentile of |pixel| by NumPy's ``inverted_cdf`` (the nearest rank), or the
    largest |pixel| where that is 0."""
    if not len(pixels):
        return 0.0
    magnitudes = np.abs(pixels)
    m = float(np.percentile(magnitudes, 99, method="inverted_cdf"))
    return m if m > 0 else float(magnitudes.max())


def check_png(path: str, tensor: Tensor) -> np.ndarray:
    size = os.stat(path).st_size
    with open(path, "rb") as stream:
        content = stream.read()
    assert len(content) == size, path
    image = Image.open(io.BytesIO(content))
    image.load()
    assert image.format == "PNG" and image.mode == "RGB"
    pixels = np.asarray(image)
    np.testing.assert_array_equal(pixels, expected_pixels(tensor.values, tensor.shape), err_msg=path)
    return pixels


def pixels_of(path: str) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image)


def has_png(tensor: Tensor) -> bool:
    return tensor.dtype in FLOATS | INTEGERS and math.prod(tensor.shape) > 0


def test_every_png_opens_in_pil_and_follows_the_pixel_rule(inspected: Mounted) -> None:
    checked = 0
    for tensor in inspected.tensors:
        path = tensor.path(inspected.root, "png")
        assert os.path.exists(path) == has_png(tensor), path
        if has_png(tensor):
            check_png(path, tensor)
            checked += 1
    assert checked == sum(1 for t in inspected.tensors if has_png(t)) > 30


def test_the_pixel_rule_on_crafted_tensors(inspected: Mounted) -> None:
    zeros = check_png(inspected.named("special.zeros").path(inspected.root, "png"), inspected.named("special.zeros"))
    assert (zeros == 255).all()  # m = 0: white
    nan = check_png(inspected.named("special.nan").path(inspected.root, "png"), inspected.named("special.nan"))
    assert (nan == 0).all()  # nothing finite: black
    scalar = check_png(inspected.named("special.scalar").path(inspected.root, "png"), inspected.named("special.scalar"))
    assert scalar.shape == (1, 1, 3) and scalar[0, 0].tolist() == [0, 0, 255]  # the one value is -m: full blue
    long = inspected.named("special.long")
    assert check_png(long.path(inspected.root, "png"), long).shape == (1, 1024, 3)
    line = check_png(inspected.named("special.line").path(inspected.root, "png"), inspected.named("special.line"))
    assert line.shape == (1, 1024, 3)  # 1-D: one row
    overflow = inspected.named("special.overflow_f64")
    assert (check_png(overflow.path(inspected.root, "png"), overflow) == [0, 0, 255]).all()  # sums past 1e308
    cube = check_png(inspected.named("special.cube").path(inspected.root, "png"), inspected.named("special.cube"))
    assert cube.shape == (5, 1024, 3)  # 5 rows of 7 x 300 columns


def test_a_tensor_bigger_than_1024_both_ways_is_averaged(inspected: Mounted) -> None:
    tensor = inspected.named("special.wide")
    pixels = check_png(tensor.path(inspected.root, "png"), tensor)
    assert pixels.shape == (1024, 1024, 3)
    assert (pixels[:3] == 0).all()  # rows 0..2 hold NaN only: pixel rows 0, 1 and 2 (i * 1100 // 1024) are black
    tall = check_png(inspected.named("special.tall").path(inspected.root, "png"), inspected.named("special.tall"))
    assert tall.shape == (1024, 2, 3)


def test_the_pixel_rule_by_hand(tmp_path: Path, mount: MountFn) -> None:
    """Tensors whose pixels can be written down: each colour, white, black, and t rounded half to even."""
    source = tmp_path / "small.safetensors"
    values = np.array([[4.0, -4.0], [0.0, np.nan]], dtype=np.float32)
    halves = np.array([1.0, -2.0, 0.5, 2.0], dtype=np.float32)
    write_serialized(source, {"a": ("F32", [2, 2], values.tobytes()), "b": ("F32", [4], halves.tobytes())})
    root = mount(str(source), options=["view=png"])
    a = pixels_of(os.path.join(root, "png", "a.png"))
    assert a.tolist() == [[[255, 0, 0], [0, 0, 255]], [[255, 255, 255], [0, 0, 0]]]
    b = pixels_of(os.path.join(root, "png", "b.png"))
    # m = 2: t = round(127.5) = 128 (half to even), round(255) = 255, round(63.75) = 64
    assert b.tolist() == [[[255, 127, 127], [0, 0, 255], [255, 191, 191], [255, 0, 0]]]


def scale_text(path: str) -> tuple[str, float]:
    """What the PNG's tEXt chunks say m is, and its value."""
    with Image.open(path) as image:
        text = image.text  # type: ignore[attr-defined]
    return text["stfs.scale"], float(text["stfs.scale.value"])


def test_the_scale_is_the_99th_percentile_of_the_pixels_not_the_largest_value(tmp_path: Path, mount: MountFn) -> None:
    """One outlier no longer washes the picture out: m is the 99th percentile (nearest rank) of |pixel|, every
    |pixel| past m is full colour, and the PNG says which scale it used."""
    source = tmp_path / "outlier.safetensors"
    outlier = np.array([0.5] * 98 + [-1.0, 50.0], dtype=np.float32)  # 100 pixels: the 99th of the sorted |v| is 1
    sparse = np.zeros(200, dtype=np.float32)
    sparse[7] = -3.0  # the 99th percentile of |pixel| is 0: m is the largest |pixel| instead
    write_serialized(
        source,
        {
            "outlier": ("F32", [100], outlier.tobytes()),
            "sparse": ("F32", [200], sparse.tobytes()),
            "zeros": ("F32", [2, 2], np.zeros(4, np.float32).tobytes()),
        },
    )
    root = mount(str(source), options=["view=png"])
    path = os.path.join(root, "png", "outlier.png")
    pixels = pixels_of(path)
    # m = 1: 0.5 gives t = round(127.5) = 128; -1 full blue; 50 clipped at t = 255 (the old rule, m = 50: t = 3)
    assert pixels[0, 0].tolist() == [255, 127, 127]
    assert pixels[0, 98].tolist() == [0, 0, 255] and pixels[0, 99].tolist() == [255, 0, 0]
    assert scale_text(path) == ("p99 of |pixel|", 1.0)
    path = os.path.join(root, "png", "sparse.png")
    pixels = pixels_of(path)
    assert pixels[0, 7].tolist() == [0, 0, 255] and (np.delete(pixels[0], 7, axis=0) == 255).all()
    assert scale_text(path) == ("max of |pixel|", 3.0)
    path = os.path.join(root, "png", "zeros.png")
    assert (pixels_of(path) == 255).all() and scale_text(path) == ("p99 of |pixel|", 0.0)
    assert all(
        os.stat(os.path.join(root, "png", name)).st_size == png_size(shape)
        for name, shape in (("outlier.png", (100,)), ("sparse.png", (200,)), ("zeros.png", (2, 2)))
    )


# -- files, folders, xattrs --------------------------------------------------------------------------------------


def test_view_files_carry_the_tensor_xattrs_and_the_view(inspected: Mounted, models: Path) -> None:
    for tensor in inspected.tensors:
        tensor_file = os.path.join(inspected.root, tensor.model, "tensors", *tensor.name.split("."))
        names = set(os.listxattr(tensor_file))
        for view in ("stats", "png"):
            path = tensor.path(inspected.root, view)
            if not os.path.exists(path):
                continue
            assert set(os.listxattr(path)) == names | {"user.stfs.view"}
            for name in names:
                assert os.getxattr(path, name) == os.getxattr(tensor_file, name)
            assert os.getxattr(path, "user.stfs.view") == view.encode()


def test_view_files_are_read_only(inspected: Mounted) -> None:
    path = inspected.named("special.wide").path(inspected.root, "stats")
    assert os.stat(path).st_mode & 0o777 == 0o444
    with pytest.raises(OSError) as raised:
        os.open(path, os.O_RDWR)
    assert raised.value.errno == errno.EROFS


def test_png_holds_only_folders_that_lead_to_a_file(inspected: Mounted) -> None:
    for dirpath, dirs, files in os.walk(os.path.join(inspected.root, "packed", "png")):
        assert dirs or files, dirpath
    assert sorted(os.listdir(os.path.join(inspected.root, "packed"))) == [
        "header.json",
        "metadata",
        "png",
        "stats",
        "tensors",
    ]


def test_preads_at_any_offset_match_the_whole_file(inspected: Mounted) -> None:
    path = inspected.named("special.wide").path(inspected.root, "png")
    whole = read_cold(path)
    assert len(whole) == os.stat(path).st_size > 3 << 20
    for offset, size in ((0, 1), (1, 4095), (4096, 1 << 20), (len(whole) - 10, 100), ((1 << 20) - 7, 300_000)):
        assert read_cold(path, offset, size) == whole[offset : offset + size]


def test_concurrent_first_reads_share_one_computation(models: Path, mount: MountFn) -> None:
    root = mount(str(models), options=["view=stats,view=png,threads"])
    paths = [
        os.path.join(root, "packed", "stats", "special", "wide.json"),
        os.path.join(root, "packed", "png", "special", "wide.png"),
    ]
    results: dict[tuple[str, int], bytes] = {}

    def reader(path: str, index: int) -> None:
        results[(path, index)] = read_cold(path)

    threads = [threading.Thread(target=reader, args=(path, i)) for path in paths for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for path in paths:
        first = results[(path, 0)]
        assert len(first) == os.stat(path).st_size
        assert all(results[(path, i)] == first for i in range(4))


def test_cli_flags_a_sharded_set_and_the_flat_layout(tmp_path: Path, require_fuse: None) -> None:
    arrays = {
        "model-00001-of-00002.safetensors": {"a.w": np.arange(6, dtype=np.float32).reshape(2, 3) - 2},
        "model-00002-of-00002.safetensors": {"b.w": np.array([[1, -7]], dtype=np.int16)},
    }
    index = write_sharded(str(tmp_path / "set"), arrays)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    command = [sys.executable, "-m", "stfs", "mount", index, str(mountpoint), "--layout", "flat"]
    result = run([*command, "--view", "stats", "-o", "view=png", "--view", "stats"])
    try:
        assert result.returncode == 0, result.stderr
        assert sorted(os.listdir(mountpoint)) == [
            "files",
            "header.json",
            "index.json",
            "metadata",
            "png",
            "shards",
            "stats",
            "tensors",
        ]
        for shard, tensors in arrays.items():
            for name, array in tensors.items():
                stats = json.loads((mountpoint / "stats" / f"{name}.json").read_bytes())
                assert stats["shape"] == list(array.shape) and stats["min"] == float(array.min())
                png = mountpoint / "png" / f"{name}.png"
                assert os.getxattr(png, "user.safetensors.file") == str(tmp_path / "set" / shard).encode()
                values = array.astype(np.float64).reshape(array.shape[0], -1)
                assert (pixels_of(str(png)) == expected_pixels(values, array.shape)).all()
    finally:
        if os.path.ismount(mountpoint):
            assert run([sys.executable, "-m", "stfs", "unmount", str(mountpoint)]).returncode == 0


# -- no read for stat; failures; memory ----------------------------------------------------------------------------


def view_files(root: str) -> list[str]:
    found = []
    for folder, _, files in os.walk(root):
        if f"{os.sep}stats" in folder or f"{os.sep}png" in folder:
            found += [os.path.join(folder, name) for name in files]
    return found


def daemon_reads(pid: int) -> int:
    """Bytes the daemon has read by read(2)/pread(2) so far (``rchar``: FUSE requests included)."""
    with open(f"/proc/{pid}/io") as stream:
        return next(int(line.split()[1]) for line in stream if line.startswith("rchar:"))


def test_stat_and_ls_read_no_tensor(models: Path, mount: MountFn) -> None:
    root = mount(str(models), options=["view=stats,view=png"])
    pid = daemon_pid(root)
    assert pid is not None
    before = daemon_reads(pid)
    files = view_files(root)
    assert len(files) > 60
    for path in files:
        os.stat(path)
        os.listxattr(path)
    assert run(["ls", "-lR", root]).returncode == 0
    assert daemon_reads(pid) - before < 256 << 10  # FUSE requests only: the tensors are several MiB
    assert "stfs-summary" not in threads_of(pid)  # and nothing was made
    with open(os.path.join(root, "packed", "stats", "special", "wide.json"), "rb") as stream:
        stream.read()
    assert daemon_reads(pid) - before > 1100 * 1300 * 4  # the tensor, read on the first read of its file


def threads_of(pid: int) -> set[str]:
    names = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/comm") as stream:
            names.add(stream.read().strip())
    return names


def test_over_http_stat_fetches_nothing_and_a_read_fetches_the_tensor_once(
    models: Path, nginx: Nginx, mount: MountFn
) -> None:
    data = (models / "packed.safetensors").read_bytes()
    url = nginx.put("packed.safetensors", data)
    root = mount(url, options=["view=stats,view=png"])
    nginx.log.clear()
    files = view_files(root)
    for path in files:
        os.stat(path)
        os.listxattr(path)
    assert run(["ls", "-lR", root]).returncode == 0
    assert nginx.log.entries(timeout=0.5) == []
    wide = next(t for t in catalog(models / "packed.safetensors", "") if t.name == "special.wide")
    check_stats(os.path.join(root, "stats", "special", "wide.json"), wide)
    check_png(os.path.join(root, "png", "special", "wide.png"), wide)
    assert read_cold(os.path.join(root, "tensors", "special", "wide")) == wide.data
    fetched = sum(entry.body_bytes for entry in nginx.log.entries())
    assert len(wide.data) <= fetched <= 1.1 * len(wide.data)  # one fetch for the three files


def test_a_failed_summary_is_eio_and_is_tried_again(
    models: Path, nginx: Nginx, fault_proxy: Callable[[str], FaultProxy], mount: MountFn
) -> None:
    nginx.put("packed.safetensors", (models / "packed.safetensors").read_bytes())
    proxy = fault_proxy(nginx.url)
    root = mount(f"{proxy.url}/packed.safetensors", options=["view=stats,view=png", "timeout=2"])
    path = os.path.join(root, "stats", "special", "wide.json")
    proxy.fail_next(1_000_000, status=503)
    with pytest.raises(OSError) as raised:
        read_cold(path)
    assert raised.value.errno == errno.EIO
    proxy.clear_faults()
    wide = next(t for t in catalog(models / "packed.safetensors", "") if t.name == "special.wide")
    check_stats(path, wide)  # not kept as failed: made again
    assert os.path.ismount(root)


def test_a_source_changed_in_place_is_eio(tmp_path: Path, mount: MountFn) -> None:
    source = tmp_path / "m.safetensors"
    write_serialized(source, {"w": ("F32", [64, 64], np.ones(4096, dtype=np.float32).tobytes())})
    root = mount(str(source), options=["view=stats,view=png"])
    os.utime(source, ns=(1, 1))
    for name in ("stats/w.json", "png/w.png"):
        with pytest.raises(OSError) as raised:
            read_cold(os.path.join(root, name))
        assert raised.value.errno == errno.EIO
    assert os.path.ismount(root) and daemon_pid(root)


@pytest.mark.timeout(300)
def test_a_256_mib_tensor_keeps_the_daemon_small(tmp_path: Path, mount: MountFn) -> None:
    source = tmp_path / "large.safetensors"
    values = 128 << 20
    write_serialized(source, {"w": ("BF16", [16384, 8192], np.random.default_rng(9).bytes(2 * values))})
    root = mount(str(source), options=["view=stats,view=png"])
    pid = daemon_pid(root)
    assert pid is not None
    before = rss_anon(pid)
    paths = [os.path.join(root, "stats", "w.json"), os.path.join(root, "png", "w.png")]
    peak = peak_rss_anon_while(pid, lambda: [dd_whole(path) for path in paths])
    assert peak - before <= (64 << 20) + os.path.getsize(paths[1]), (before, peak)
    with Image.open(os.path.join(root, "png", "w.png")) as image:
        assert image.size == (1024, 1024)


# -- plain functions: the sizes promised and the cache -------------------------------------------------------------


def test_the_longest_float_repr_is_24_characters() -> None:
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**64, 200_000, dtype=np.uint64).view(np.float64)
    lengths = {len(repr(float(x))) for x in bits if np.isfinite(x)}
    assert max(lengths) <= 24
    assert len(repr(-2.2250738585072014e-308)) == 24


@pytest.mark.parametrize("count", [0, 1, 9, 10, 4800, 10**12])
def test_a_stats_document_never_outgrows_its_size(count: int) -> None:
    entry = TensorEntry("t", "F64", (count,), 0, count * 8)
    longest = {"dtype": "F64", "shape": [count]}
    number, value = count, -1.2345678901234567e-300
    longest |= {key: number for key in ("count", "finite", "nan", "posinf", "neginf", "zeros")}
    longest |= {key: value for key in ("min", "max", "mean", "std", "abs_max")}
    longest["histogram"] = {"edges": [value] * 65, "counts": [number] * 64}
    assert len(render(longest)) < stats_size(entry)


@pytest.mark.parametrize("shape", [(1,), (3, 5), (1024, 1024), (7, 3000), (2000, 1), (1, 65535), (22, 993)])
def test_png_sizes_do_not_depend_on_the_pixels(shape: tuple[int, ...]) -> None:
    from stfs.heatmap import LARGEST, encode, grid

    _, _, height, width = grid(shape)
    noise = np.random.default_rng(1).integers(0, 256, (height, width, 3), dtype=np.uint8)
    assert len(encode(noise, LARGEST, -2.2250738585072014e-308)) == png_size(shape)  # the longest scale text


def _bytes_source(data: bytes) -> Callable[[str, int, memoryview, tuple[int, int]], int]:
    def read(key: str, offset: int, view: memoryview, span: tuple[int, int]) -> int:
        piece = data[offset : offset + len(view)]
        view[: len(piece)] = piece
        return len(piece)

    return read


def test_the_cache_makes_each_file_once_and_forgets_failures() -> None:
    from stfs.nodes import Summary

    calls: list[int] = []
    fail = [True]

    def make(tensor: TensorBytes, size: int) -> bytes:
        calls.append(size)
        if fail[0]:
            raise OSError("the source went away")
        return b"x" * size

    finished = Finished(max_bytes=100)
    entry = TensorEntry("t", "U8", (4,), 0, 4)
    segment = Summary("k", 0, 10, entry, make, finished)
    read = TensorBytes("k", 0, 4, "U8", (4,), _bytes_source(b"abcd"))
    with pytest.raises(OSError):
        finished.bytes_of(segment, make, read)
    fail[0] = False
    results: list[bytes] = []
    threads = [
        threading.Thread(target=lambda: results.append(finished.bytes_of(segment, make, read))) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [b"x" * 10] * 8 and len(calls) == 2  # the failure, then one making for eight readers
    big = [Summary("k", 0, 60, entry, make, finished) for _ in range(2)]
    for segment in big:
        finished.bytes_of(segment, make, read)
    finished.bytes_of(big[0], make, read)  # evicted by the second: 120 bytes do not fit in 100
    assert len(calls) == 5


def test_every_view_name_is_a_choice_of_view_and_o_view() -> None:
    from stfs.options import VIEWS, sort_options
    from stfs.views import CHOSEN

    assert set(VIEWS) == set(CHOSEN)
    assert sort_options(["view=stats,view=png", "view=npy"]).settings == {"views": ["stats", "png", "npy"]}
