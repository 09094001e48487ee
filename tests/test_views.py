"""``--view npy`` and ``--view f32``, really mounted: every dtype of safetensors 0.8, bytes and values checked
against a reference decoding (tests/test_decode.py), headers parsed by hand, a C program, random reads."""

from __future__ import annotations

import io
import math
import os
import random
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from stfs.daemon import daemon_pid, mounted
from stfs.decode import NATIVE
from stfs.formats.safetensors import DTYPE_BITS
from tests.decoding import every_code, parse_npy_header, reference
from tests.helpers import MountFn, dd_whole, need_fuse, peak_rss_anon_while, rss_anon, run
from tests.models import (
    FLOAT_DTYPES,
    read_tensors,
    rich_arrays,
    sharded_arrays,
    write_by_hand,
    write_numpy,
    write_serialized,
    write_sharded,
)

ALL_DTYPES = sorted(DTYPE_BITS)
FLOATS = FLOAT_DTYPES
BIG = 400_000  # values: a decoded file of 1.6 MB spans several 1 MiB requests


def normal(count: int, dtype: type) -> bytes:
    """Finite values (no NaN codes): what a sum can be checked on."""
    return np.random.default_rng(count).standard_normal(count).astype(dtype).tobytes()


def write_models(folder: Path) -> None:
    """Three models: numpy's dtypes (safetensors.numpy), BF16/F8/F4 (safetensors.serialize), F6 (by hand)."""
    folder.mkdir()
    arrays = rich_arrays()
    arrays["big.f32"] = np.random.default_rng(5).standard_normal(BIG // 2).astype(np.float32)
    write_numpy(str(folder / "native.safetensors"), arrays)
    packed: dict[str, tuple[str, list[int], bytes]] = {
        "big.bf16": ("BF16", [BIG // 500, 500], every_code("BF16", BIG, seed=2)),
        "small.bf16": ("BF16", [3, 5], every_code("BF16", 15, seed=3)),
        "scalar.bf16": ("BF16", [], every_code("BF16", 1, seed=4)),
        "empty.bf16": ("BF16", [0, 3], b""),
        "f4": ("F4", [40, 250], every_code("F4", 10_000, seed=6)),
        "normal.bf16": ("BF16", [BIG // 2], normal(BIG // 2, ml_dtypes.bfloat16)),
        "normal.f8": ("F8_E4M3", [5000], normal(5000, ml_dtypes.float8_e4m3fn)),
        "empty.f4": ("F4", [2, 0], b""),
    }
    for seed, dtype in enumerate(("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0")):
        packed[f"f8.{dtype[3:].lower()}"] = (dtype, [16, 300], every_code(dtype, 4800, seed=10 + seed))
    write_serialized(folder / "packed.safetensors", packed)
    write_by_hand(
        folder / "hand.safetensors",
        {
            "f6.e2m3": ("F6_E2M3", [64, 12], every_code("F6_E2M3", 768, seed=7)),
            "f6.e3m2": ("F6_E3M2", [BIG], every_code("F6_E3M2", BIG, seed=8)),
        },
    )


@dataclass
class Tensor:
    model: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes
    file: str
    offset: int

    @property
    def path(self) -> str:
        return self.name.replace(".", "/")

    def npy_array(self) -> np.ndarray:
        """What ``np.load`` of its npy/ file must give."""
        if self.dtype in NATIVE:
            return np.frombuffer(self.data, dtype=NATIVE[self.dtype]).reshape(self.shape)
        return reference(self.data, self.dtype).reshape(self.shape)

    def f32_bytes(self) -> bytes:
        if self.dtype == "F32":
            return self.data
        return reference(self.data, self.dtype).tobytes()


def catalog(source: str, model: str = "") -> list[Tensor]:
    """Every tensor of a safetensors file, read straight from it (independent of stfs)."""
    return [
        Tensor(model, name, dtype, shape, data, os.path.abspath(source), offset)
        for name, dtype, shape, data, offset in read_tensors(source)
    ]


@dataclass
class Mounted:
    root: str
    tensors: list[Tensor]

    def file(self, tensor: Tensor, view: str) -> str:
        suffix = ".npy" if view == "npy" else ""
        return os.path.join(self.root, tensor.model, view, tensor.path + suffix)

    def of(self, dtype: str) -> list[Tensor]:
        found = [tensor for tensor in self.tensors if tensor.dtype == dtype]
        assert found, dtype
        return found


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("views") / "models"
    write_models(folder)
    return folder


@pytest.fixture(scope="module")
def views(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mounted]:
    """The three models mounted once with both views (``-o view=npy,view=f32``)."""
    need_fuse()
    tensors = [t for name in ("native", "packed", "hand") for t in catalog(str(models / f"{name}.safetensors"), name)]
    assert {tensor.dtype for tensor in tensors} == set(DTYPE_BITS)
    with mounted(str(models), str(tmp_path_factory.mktemp("mnt")), options=["view=npy,view=f32"]) as root:
        yield Mounted(root, tensors)


def save_bytes(array: np.ndarray) -> bytes:
    stream = io.BytesIO()
    np.save(stream, array)
    return stream.getvalue()


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_npy_files_load_as_the_reference(views: Mounted, dtype: str) -> None:
    for tensor in views.of(dtype):
        path = views.file(tensor, "npy")
        expected = tensor.npy_array()
        content = save_bytes(expected)
        assert os.stat(path).st_size == len(content)  # exact before any read
        for loaded in (np.load(path), np.load(path, mmap_mode="r")):
            assert loaded.dtype == NATIVE.get(dtype, np.float32)
            assert loaded.shape == tensor.shape
            np.testing.assert_array_equal(loaded, expected)
        assert Path(path).read_bytes() == content  # what np.save writes, byte for byte


def test_npy_headers_parsed_by_hand(views: Mounted) -> None:
    for tensor in views.tensors:
        with open(views.file(tensor, "npy"), "rb") as stream:
            data = stream.read()
        version, fields, start = parse_npy_header(data)
        assert version == (1, 0) and start % 64 == 0
        descr = NATIVE[tensor.dtype].str if tensor.dtype in NATIVE else "<f4"
        assert fields == {"descr": descr, "fortran_order": False, "shape": tensor.shape}, tensor.name
        if tensor.dtype in NATIVE:
            assert data[start:] == tensor.data  # native dtypes keep their bytes
        else:
            assert len(data) - start == 4 * math.prod(tensor.shape)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_f32_files_of_float_tensors_only(views: Mounted, dtype: str) -> None:
    for tensor in views.of(dtype):
        path = views.file(tensor, "f32")
        if dtype not in FLOATS:
            assert not os.path.exists(path), path
            continue
        expected = tensor.f32_bytes()
        assert os.stat(path).st_size == len(expected) == 4 * math.prod(tensor.shape)
        assert Path(path).read_bytes() == expected
        np.testing.assert_array_equal(np.fromfile(path, dtype="<f4"), np.frombuffer(expected, dtype="<f4"))


def test_f32_holds_only_folders_that_lead_to_a_file(views: Mounted) -> None:
    for model in ("native", "packed", "hand"):
        top = os.path.join(views.root, model, "f32")
        found = set()
        for folder, folders, files in os.walk(top):
            assert files or folders, folder
            found |= {os.path.relpath(os.path.join(folder, name), top) for name in files}
        expected = {t.path for t in views.tensors if t.model == model and t.dtype in FLOATS}
        assert found == expected
    assert not os.path.exists(os.path.join(views.root, "native", "f32", "counts"))  # integers only


def test_view_files_carry_the_tensor_xattrs_and_the_view(views: Mounted) -> None:
    for tensor in views.tensors:
        raw = os.path.join(views.root, tensor.model, "tensors", tensor.path)
        expected = {name: os.getxattr(raw, name) for name in os.listxattr(raw)}
        assert expected["user.safetensors.file"] == tensor.file.encode()
        assert expected["user.safetensors.offset"] == str(tensor.offset).encode()
        assert "user.stfs.view" not in expected
        for view in ("npy", "f32") if tensor.dtype in FLOATS else ("npy",):
            path = views.file(tensor, view)
            got = {name: os.getxattr(path, name) for name in os.listxattr(path)}
            assert got == {**expected, "user.stfs.view": view.encode()}


def test_empty_and_scalar_tensors(views: Mounted) -> None:
    names = {tensor.name: tensor for tensor in views.tensors}
    scalar, empty = names["scalar.bf16"], names["empty.bf16"]
    loaded = np.load(views.file(scalar, "npy"))
    assert loaded.shape == () and loaded.dtype == np.float32 and loaded == reference(scalar.data, "BF16")[0]
    assert os.path.getsize(views.file(scalar, "f32")) == 4
    assert np.load(views.file(empty, "npy")).shape == (0, 3)
    assert np.load(views.file(empty, "npy"), mmap_mode="r").shape == (0, 3)
    assert os.path.getsize(views.file(empty, "f32")) == 0 and Path(views.file(empty, "f32")).read_bytes() == b""
    assert np.load(views.file(names["empty.f4"], "npy")).shape == (2, 0)
    native_scalar = np.load(views.file(names["scalar"], "npy"))
    assert native_scalar.shape == () and native_scalar == np.float32(3.5)
    assert np.load(views.file(names["empty"], "npy"), mmap_mode="r").shape == (0, 4)


def test_view_files_are_read_only(views: Mounted) -> None:
    tensor = views.of("BF16")[0]
    for path in (views.file(tensor, "npy"), views.file(tensor, "f32")):
        with pytest.raises(OSError) as caught:
            os.open(path, os.O_WRONLY)
        assert caught.value.errno == 30  # EROFS


C_SUM = r"""
#include <stdio.h>
int main(int argc, char **argv) {
    FILE *f = fopen(argv[1], "rb");
    if (!f) return 2;
    float block[4096], sum = 0.0f;
    double exact = 0.0, magnitude = 0.0;
    size_t got, count = 0;
    while ((got = fread(block, sizeof(float), 4096, f)) > 0) {
        for (size_t i = 0; i < got; i++) {
            sum += block[i];
            exact += block[i];
            magnitude += block[i] < 0 ? -block[i] : block[i];
        }
        count += got;
    }
    fclose(f);
    printf("%zu %.9g %.17g %.17g\n", count, sum, exact, magnitude);
    return 0;
}
"""


def test_a_c_program_freads_f32_files(views: Mounted, tmp_path: Path) -> None:
    (tmp_path / "sum.c").write_text(C_SUM)
    binary = str(tmp_path / "sum")
    compiled = run(["gcc", "-O1", "-o", binary, str(tmp_path / "sum.c")])
    assert compiled.returncode == 0, compiled.stderr
    names = {tensor.name: tensor for tensor in views.tensors}
    for name in ("normal.bf16", "normal.f8", "f6.e3m2", "f6.e2m3", "f4", "big.f32", "model.layers.0.mlp.up_proj.bias"):
        tensor = names[name]
        values = np.frombuffer(tensor.f32_bytes(), dtype=np.float32)
        assert np.isfinite(values).all()
        result = run([binary, views.file(tensor, "f32")])
        assert result.returncode == 0, result.stderr
        count, total, exact, magnitude = result.stdout.split()
        assert int(count) == values.size
        # Summation in float32 errs by at most (n - 1) u sum|x| in order (C), log2(n) u sum|x| pairwise (numpy)
        bound = (values.size + math.log2(values.size) + 1) * 2.0**-24 * float(magnitude)
        assert abs(float(total) - float(np.sum(values))) <= bound, name
        assert float(exact) == pytest.approx(float(np.sum(values, dtype=np.float64)), rel=1e-12, abs=1e-300)


def boundary_reads(size: int, header: int, rng: random.Random, count: int) -> Iterator[tuple[int, int]]:
    """(offset, length) pairs around the header's end and the 1 MiB request boundaries, and anywhere."""
    edges = [header, *range(1 << 20, size, 1 << 20), size]
    for _ in range(count):
        edge = rng.choice(edges)
        offset = max(0, min(size, edge + rng.randint(-9000, 9000))) if rng.random() < 0.8 else rng.randrange(size)
        yield offset, rng.choice([1, 3, 4, 15, 4095, 4097, 70_000, 1 << 20, 3 << 20])


def pread_files(views: Mounted) -> list[tuple[str, bytes, int]]:
    names = {tensor.name: tensor for tensor in views.tensors}
    files = []
    for name in ("big.f32", "big.bf16", "f6.e3m2", "f4"):
        tensor = names[name]
        content = save_bytes(tensor.npy_array())
        files.append((views.file(tensor, "npy"), content, parse_npy_header(content)[2]))
        files.append((views.file(tensor, "f32"), tensor.f32_bytes(), 0))
    return files


def test_preads_across_the_header_and_request_boundaries(views: Mounted) -> None:
    """Each read with the file's page cache dropped first, so the daemon serves it (page-aligned, as asked)."""
    rng = random.Random(11)
    for path, content, header in pread_files(views):
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset, length in boundary_reads(len(content), header, rng, 40):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                assert os.pread(fd, length, offset) == content[offset : offset + length], (path, offset, length)
        finally:
            os.close(fd)


def test_direct_io_reads_at_any_offset(models: Path, mount: MountFn) -> None:
    """With ``-o direct_io`` every read reaches the daemon at its own offset and size: the decoded ones begin and
    end inside source values and groups (F4, F6)."""
    root = mount(str(models), options=["view=npy,view=f32", "direct_io"])
    tensors = [t for name in ("native", "packed", "hand") for t in catalog(str(models / f"{name}.safetensors"), name)]
    rng = random.Random(12)
    for path, content, header in pread_files(Mounted(root, tensors)):
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset, length in boundary_reads(len(content), header, rng, 60):
                assert os.pread(fd, length, offset) == content[offset : offset + length], (path, offset, length)
        finally:
            os.close(fd)
        assert Path(path).read_bytes() == content


def test_concurrent_readers_of_decoded_files_with_threads(models: Path, mount: MountFn) -> None:
    """libfuse's thread pool: each thread decodes into its own scratch pages, lent to its own pipe."""
    root = mount(str(models), options=["view=npy,view=f32,threads", "direct_io"])
    tensors = [t for name in ("native", "packed", "hand") for t in catalog(str(models / f"{name}.safetensors"), name)]
    files = pread_files(Mounted(root, tensors))
    failures: list[tuple[str, int, int]] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(80):
            path, content, header = rng.choice(files)
            offset, length = next(boundary_reads(len(content), header, rng, 1))
            fd = os.open(path, os.O_RDONLY)
            try:
                if os.pread(fd, length, offset) != content[offset : offset + length]:
                    failures.append((path, offset, length))
            finally:
                os.close(fd)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_cli_view_flags_with_the_flat_layout(models: Path, tmp_path: Path, require_fuse: None) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    source = str(models / "native.safetensors")
    command = [sys.executable, "-m", "stfs", "mount", source, str(mountpoint), "--layout", "flat", "--view", "npy"]
    result = run([*command, "--view", "f32", "--view", "npy"])
    try:
        assert result.returncode == 0, result.stderr
        assert sorted(os.listdir(mountpoint)) == ["f32", "files", "header.json", "metadata", "npy", "tensors"]
        for tensor in catalog(source):
            assert os.path.isfile(mountpoint / "tensors" / tensor.name)
            np.testing.assert_array_equal(np.load(mountpoint / "npy" / f"{tensor.name}.npy"), tensor.npy_array())
            f32 = mountpoint / "f32" / tensor.name
            assert f32.is_file() == (tensor.dtype in FLOATS)
            if tensor.dtype in FLOATS:
                assert f32.read_bytes() == tensor.f32_bytes()
    finally:
        if os.path.ismount(mountpoint):
            assert run([sys.executable, "-m", "stfs", "unmount", str(mountpoint)]).returncode == 0


def test_a_sharded_set(tmp_path: Path, mount: MountFn) -> None:
    index = write_sharded(str(tmp_path / "set"), sharded_arrays())
    root = Path(mount(index, options=["view=f32", "view=npy"]))
    for shard, arrays in sharded_arrays().items():
        for name, array in arrays.items():
            path = name.replace(".", "/")
            npy = root / "npy" / f"{path}.npy"
            np.testing.assert_array_equal(np.load(npy, mmap_mode="r"), array)
            assert np.load(npy).dtype == array.dtype
            assert (root / "f32" / path).read_bytes() == array.astype("<f4").tobytes()
            for view in ("npy", "f32"):
                file = root / view / (f"{path}.npy" if view == "npy" else path)
                assert os.getxattr(file, "user.safetensors.file") == str(tmp_path / "set" / shard).encode()
                assert os.getxattr(file, "user.stfs.view") == view.encode()


@pytest.mark.parametrize("spelling", [["--view", "bogus"], ["-o", "view=bogus"], ["--view"]])
def test_an_unknown_view_is_a_usage_error(models: Path, tmp_path: Path, spelling: list[str]) -> None:
    source = str(models / "native.safetensors")
    result = run([sys.executable, "-m", "stfs", "mount", source, str(tmp_path), *spelling])
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("stfs mount: error: ") and "view" in result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert not os.path.ismount(tmp_path)


@pytest.mark.timeout(300)
def test_decoding_a_large_tensor_keeps_the_daemon_small(tmp_path: Path, mount: MountFn) -> None:
    """A 96 MiB BF16 tensor: its 192 MiB f32/ file and .npy go through the daemon in bounded pieces."""
    source = tmp_path / "large.safetensors"
    values = 48 << 20
    write_serialized(source, {"w": ("BF16", [values], np.random.default_rng(9).bytes(2 * values))})
    root = mount(str(source), options=["view=f32,view=npy"])
    pid = daemon_pid(root)
    assert pid is not None
    before = rss_anon(pid)
    paths = [os.path.join(root, "f32", "w"), os.path.join(root, "npy", "w.npy")]
    peak = peak_rss_anon_while(pid, lambda: [dd_whole(path) for path in paths])
    assert peak - before <= 64 << 20, (before, peak)
