"""HDF5 weights (SPEC §17, docs/hdf5.md): files h5py and Keras 3 (torch backend) write during the run, read through
a real mount and compared with h5py's ``dataset[()]``; attributes in metadata/; ``.keras`` zips; refusals in one line
naming the dataset; a remote file's info by Range; ``--view safetensors`` names."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.hdf5_files import WRITERS, h5py_tensors, many_links, write_h5py, write_keras
from tests.helpers import MountFn, refusal, run, short_fuzz_run, stfs_command, tensor_path

h5py = pytest.importorskip("h5py")

MIB = 1 << 20


def tensor_file(mnt: str, name: str, folder: str = "tensors") -> Path:
    return Path(mnt, folder, *name.split("."))


def assert_same_as_h5py(source: Path, mnt: str) -> None:
    """Every dataset h5py reads is a tensor file of the same bytes, its dtype and shape in its xattrs."""
    reference = h5py_tensors(source)
    header = json.loads(Path(mnt, "header.json").read_bytes())
    assert set(header) - {"__metadata__"} == set(reference)
    for name, (dtype, shape, data) in reference.items():
        path = tensor_file(mnt, name)
        assert path.read_bytes() == data, name
        assert json.loads(os.getxattr(path, "user.hdf5.shape")) == shape == header[name]["shape"]
        assert header[name]["dtype"] == os.getxattr(path, "user.hdf5.dtype").decode()
        if dtype != "|V2":  # Keras' bfloat16: opaque to h5py
            assert np.dtype(dtype).itemsize * int(np.prod(shape)) == os.stat(path).st_size


def safetensors_dtype(numpy_dtype: str) -> str:
    """Safetensors' name of a numpy dtype of numbers: ``float32`` -> ``F32``, ``bool`` -> ``BOOL``."""
    dtype = np.dtype(numpy_dtype)
    return "BOOL" if dtype.kind == "b" else {"f": "F", "i": "I", "u": "U"}[dtype.kind] + str(8 * dtype.itemsize)


@pytest.mark.parametrize("kind", list(WRITERS))
def test_every_dataset_is_a_tensor_file_of_the_bytes_h5py_reads(tmp_path: Path, mount: MountFn, kind: str) -> None:
    source = WRITERS[kind](tmp_path / f"{kind}.h5")
    mnt = mount(str(source))
    assert_same_as_h5py(source, mnt)
    metadata = Path(mnt, "metadata")
    assert json.loads((metadata / "keras_version").read_text()) == "2.15.0"
    assert json.loads((metadata / "backend").read_text()) == "tensorflow"
    assert json.loads((metadata / "numbers").read_text()) == [0, 1, 2]
    assert json.loads(Path(metadata, "a.weight_names").read_text()) == ["a/f32", "a/f16"]
    assert os.getxattr(tensor_file(mnt, "a.f32"), "user.hdf5.dataset") == b"/a/f32"


@pytest.mark.parametrize(
    ("kind", "version"), [("earliest", 0), ("superblock-v1", 1), ("superblock-v2", 2), ("latest", 3), ("userblock", 3)]
)
def test_superblock_versions_0_to_3(tmp_path: Path, kind: str, version: int) -> None:
    """Each superblock version libhdf5 writes: ``stfs info`` lists every dataset h5py reads, in its shape and dtype
    (the test above reads each through a mount)."""
    source = WRITERS[kind](tmp_path / f"{kind}.h5")
    start = 512 if kind == "userblock" else 0
    assert source.read_bytes()[start : start + 9] == b"\x89HDF\r\n\x1a\n" + bytes([version])
    result = stfs_command("info", "--json", str(source))
    assert result.returncode == 0 and not result.stderr, result.stderr
    found = {t["name"]: (t["dtype"], t["shape"]) for t in json.loads(result.stdout)["models"][0]["tensors"]}
    assert found == {
        name: (safetensors_dtype(dtype), shape) for name, (dtype, shape, _) in h5py_tensors(source).items()
    }


@pytest.mark.parametrize(
    ("libver", "track_order"),
    [("latest", False), ("earliest", True), ("earliest", False)],
    ids=["libver-latest", "track-order", "symbol-table"],
)
def test_a_group_of_many_links_and_attributes(tmp_path: Path, mount: MountFn, libver: str, track_order: bool) -> None:
    source = many_links(tmp_path / "many.h5", 200, libver=libver, track_order=track_order)
    with h5py.File(source) as file:
        assert len(file["many"]) == 200
    data = source.read_bytes()
    if libver == "latest" or track_order:  # dense links: in a fractal heap indexed by a v2 B-tree, not the header
        assert b"FRHP" in data and b"BTHD" in data
    else:  # a symbol table: a B-tree of symbol table nodes (more than one: 200 links) and a local heap
        assert data.count(b"SNOD") > 1 and b"HEAP" in data
    mnt = mount(str(source))
    assert_same_as_h5py(source, mnt)
    assert len(os.listdir(Path(mnt, "tensors", "many"))) == 200
    assert Path(mnt, "metadata", "many.attr123").read_text() == "123\n"


@pytest.mark.parametrize(
    ("chunks", "maxshape"),
    [((2, 3), None), ((4, 1), None), ((2, 2), (None, None)), ((1, 2), (None, 7)), ((3, 1), (9, None))],
)
@pytest.mark.parametrize("libver", ["earliest", "latest"])
def test_chunked_datasets_are_gathered_from_their_chunks(
    tmp_path: Path, mount: MountFn, chunks: tuple[int, int], maxshape: tuple[None, None] | None, libver: str
) -> None:
    rng = np.random.default_rng(11)
    arrays = {"w": rng.standard_normal((9, 7)).astype(np.float32), "v": np.arange(5000, dtype=np.int32)}
    source = tmp_path / "chunked.h5"
    with h5py.File(source, "w", libver=(libver, "latest") if libver == "latest" else "earliest") as file:
        file.create_dataset("w", data=arrays["w"], chunks=chunks, maxshape=maxshape)
        file.create_dataset("v", data=arrays["v"], chunks=(3,))  # a fixed array of pages with libver latest
        file.create_dataset("grown", data=arrays["v"], chunks=(2,), maxshape=(None,))  # secondary blocks
        file.create_dataset("cube", data=np.arange(120, dtype=np.int16).reshape(2, 3, 4, 5), chunks=(1, 2, 3, 2))
    mnt = mount(str(source), options=["view=npy"])
    assert_same_as_h5py(source, mnt)
    assert np.array_equal(np.load(tensor_file(mnt, "w", "npy").with_suffix(".npy")), arrays["w"])


def test_an_extensible_array_whose_data_blocks_are_paged(tmp_path: Path, mount: MountFn) -> None:
    # libhdf5 pages a data block of more than 1,024 addresses: past the first 131,060 chunks of a growable dataset
    values = (np.arange(134_000) * 7 % 65521).astype("<u2")
    source = tmp_path / "paged.h5"
    with h5py.File(source, "w", libver="latest") as file:
        file.create_dataset("x", data=values, chunks=(1,), maxshape=(None,))
    mnt = mount(str(source))
    assert Path(tensor_path(mnt, "x")).read_bytes() == values.tobytes()
    assert_same_as_h5py(source, mnt)


def test_keras_weights_and_a_keras_file_with_bfloat16(tmp_path: Path, mount: MountFn) -> None:
    weights, whole, legacy = write_keras(tmp_path)
    mnt = mount(str(tmp_path), options=["view=f32"])
    import zipfile

    with zipfile.ZipFile(whole) as archive:
        archive.extract("model.weights.h5", tmp_path / "inner")
        config = archive.read("config.json").decode()
    for model, h5 in ((Path(mnt, "net.weights"), weights), (Path(mnt, "net"), tmp_path / "inner" / "model.weights.h5")):
        assert_same_as_h5py(h5, str(model))
        kernel = tensor_file(str(model), "layers.dense.vars.0")
        assert os.getxattr(kernel, "user.hdf5.dtype") == b"BF16"
        import ml_dtypes

        raw = np.frombuffer(kernel.read_bytes(), dtype=ml_dtypes.bfloat16)
        f32 = np.frombuffer(tensor_file(str(model), "layers.dense.vars.0", "f32").read_bytes(), np.float32)
        assert np.array_equal(raw.astype(np.float32), f32)
    assert Path(mnt, "net", "metadata", "config.json").read_text() == config.rstrip("\n") + "\n"
    assert_same_as_h5py(legacy, str(Path(mnt, "legacy")))
    metadata = Path(mnt, "legacy", "metadata")
    assert json.loads((metadata / "model_weights.layer_names").read_text()) == ["first", "norm", "last"]
    assert json.loads(json.loads((metadata / "model_config").read_text()))["config"]["name"] == "net"
    assert json.loads(Path(mnt, "net", "metadata", "metadata.json").read_text())["keras_version"]


@pytest.mark.parametrize("marker", ["bfloat16", b"bfloat16"], ids=["str", "bytes"])
def test_a_bfloat16_stored_as_uint16_with_a_dtype_attribute_is_bf16(
    tmp_path: Path, mount: MountFn, marker: str | bytes
) -> None:
    """A ``uint16`` dataset whose ``dtype`` attribute says ``bfloat16`` (a variable-length or a fixed-length
    string) is BF16, its bytes as stored; without the attribute it stays U16."""
    import ml_dtypes

    values = np.linspace(-3, 5, 42, dtype=np.float32).reshape(6, 7).astype(ml_dtypes.bfloat16)
    source = tmp_path / "bf16.h5"
    with h5py.File(source, "w") as file:
        file.create_dataset("dense/kernel", data=values.view(np.uint16)).attrs["dtype"] = marker
        file.create_dataset("dense/chunked", data=values.view(np.uint16), chunks=(2, 3)).attrs["dtype"] = marker
        file.create_dataset("dense/bits", data=values.view(np.uint16))
    with h5py.File(source) as file:
        assert file["dense/kernel"].dtype == np.uint16
    mnt = mount(str(source), options=["view=f32"])
    assert_same_as_h5py(source, mnt)
    for name in ("dense.kernel", "dense.chunked"):
        path = tensor_file(mnt, name)
        assert os.getxattr(path, "user.hdf5.dtype") == b"BF16"
        assert path.read_bytes() == values.tobytes()
        f32 = np.frombuffer(tensor_file(mnt, name, "f32").read_bytes(), np.float32).reshape(6, 7)
        assert np.array_equal(f32, values.astype(np.float32))
    assert os.getxattr(tensor_file(mnt, "dense.bits"), "user.hdf5.dtype") == b"U16"


def refused(tmp_path: Path, name: str, make: object) -> str:
    """The one line ``stfs check`` prints for the file h5py wrote with ``make(file)``."""
    source = tmp_path / "refused.h5"
    with h5py.File(source, "w") as file:
        file.create_dataset("fine", data=np.ones(3, np.float32))
        make(file)  # type: ignore[operator]
    result = stfs_command("info", str(source))
    assert result.returncode == 1, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(source) in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert f"tensor {name!r}" in lines[0], lines[0]
    return lines[0]


def _virtual(file: h5py.File) -> None:
    layout = h5py.VirtualLayout(shape=(3,), dtype=np.float32)
    layout[:] = h5py.VirtualSource(file["fine"])
    file.create_virtual_dataset("bad", layout)


def _odd_float(file: h5py.File) -> None:
    odd = h5py.h5t.IEEE_F32LE.copy()
    odd.set_ebias(100)  # not IEEE's 127: h5py converts the values, the bytes are not float32's
    file.create_dataset("bad", data=np.ones(3, np.float32), dtype=h5py.Datatype(odd))


CASES = {
    "gzip": (lambda f: f.create_dataset("bad", data=np.ones(99, np.float32), compression="gzip"), "gzip"),
    "lzf": (lambda f: f.create_dataset("bad", data=np.ones(99, np.float32), compression="lzf"), "lzf"),
    "shuffle": (lambda f: f.create_dataset("bad", data=np.ones(99, np.float32), shuffle=True), "shuffle"),
    "big-endian": (lambda f: f.create_dataset("bad", data=np.ones(3, ">f4")), "big-endian"),
    "compound": (lambda f: f.create_dataset("bad", data=np.zeros(2, "i4,f4")), "compound"),
    "string": (lambda f: f.create_dataset("bad", data=np.array([b"ab", b"cd"])), "string"),
    "vlen-string": (
        lambda f: f.create_dataset("bad", data=["ab", "cde"], dtype=h5py.string_dtype()),
        "variable-length",
    ),
    "vlen": (lambda f: f.create_dataset("bad", (2,), dtype=h5py.vlen_dtype(np.int32)), "variable-length"),
    "reference": (lambda f: f.create_dataset("bad", data=[f["fine"].ref], dtype=h5py.ref_dtype), "reference"),
    "external": (lambda f: f.create_dataset("bad", (4,), np.float32, external=[("ext.bin", 0, 16)]), "external"),
    "virtual": (_virtual, "virtual"),
    "float-not-ieee": (_odd_float, "floating-point"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_dataset_stfs_cannot_serve_is_refused_in_one_line_naming_it(tmp_path: Path, case: str) -> None:
    make, words = CASES[case]
    line = refused(tmp_path, "bad", make)
    assert words in line


def test_a_refused_file_is_not_mounted(tmp_path: Path, require_fuse: None) -> None:
    source = tmp_path / "gz.h5"
    with h5py.File(source, "w") as file:
        file.create_dataset("layer/kernel", data=np.ones(500, np.float32), compression="gzip")
    result = refusal(source, tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "'layer.kernel'" in lines[0] and "gzip" in lines[0], result.stderr


def test_remote_info_reads_the_metadata_not_the_weights(nginx: object, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    arrays = {f"model/layer{i}/kernel": rng.standard_normal((256, 256)).astype(np.float32) for i in range(64)}
    local = write_h5py(tmp_path / "tf_model.h5", arrays)
    assert local.stat().st_size > 16 * MIB
    url = nginx.put("tf_model.h5", local.read_bytes())  # type: ignore[attr-defined]
    nginx.log.clear()  # type: ignore[attr-defined]
    result = run([sys.executable, "-m", "stfs", "info", url, "--json"])
    assert result.returncode == 0, result.stderr
    tensors = json.loads(result.stdout)["models"][0]["tensors"]
    assert len(tensors) == 64
    transfer = nginx.log.transfer()  # type: ignore[attr-defined]
    assert transfer.bytes <= MIB, transfer
    assert json.loads(result.stdout)["transfer"]["bytes"] == transfer.bytes


def test_a_remote_file_mounts_and_serves_what_h5py_reads(nginx: object, tmp_path: Path, mount: MountFn) -> None:
    local = tmp_path / "chunked.h5"
    with h5py.File(local, "w") as file:
        file.create_dataset("w", data=np.arange(63, dtype=np.float32).reshape(9, 7), chunks=(2, 3))
        file.create_dataset("v", data=np.arange(5000, dtype=np.int32), chunks=(3,))
        file.create_dataset("plain", data=np.arange(1000, dtype=np.float64))
    url = nginx.put("chunked.h5", local.read_bytes())  # type: ignore[attr-defined]
    mnt = mount(url)
    assert_same_as_h5py(local, mnt)


def test_view_safetensors_names_tf_model_h5(tmp_path: Path, mount: MountFn) -> None:
    from safetensors.numpy import load_file, save_file

    alone = tmp_path / "alone"
    alone.mkdir()
    write_h5py(alone / "tf_model.h5", {"bert/w": np.ones((2, 3), np.float32)})
    mnt = mount(str(alone), options=["view=safetensors"])
    assert sorted(os.listdir(Path(mnt, "safetensors"))) == ["model.safetensors"]
    loaded = load_file(str(Path(mnt, "safetensors", "model.safetensors")))
    assert np.array_equal(loaded["bert.w"], np.ones((2, 3), np.float32))

    beside = tmp_path / "beside"
    beside.mkdir()
    write_h5py(beside / "tf_model.h5", {"bert/w": np.ones((2, 3), np.float32)})
    save_file({"bert.w": np.zeros((2, 3), np.float32)}, str(beside / "model.safetensors"))
    mnt = mount(str(beside), options=["view=safetensors"])
    assert sorted(os.listdir(Path(mnt, "safetensors"))) == ["model.safetensors", "tf_model.safetensors"]
    assert Path(mnt, "safetensors", "model.safetensors").read_bytes() == (beside / "model.safetensors").read_bytes()
    assert np.array_equal(load_file(str(Path(mnt, "safetensors", "tf_model.safetensors")))["bert.w"], np.ones((2, 3)))


def test_lookup3_is_jenkins_hashlittle() -> None:
    from stfs.formats.hdf5.io import lookup3

    assert lookup3(b"") == 0xDEADBEEF
    assert lookup3(b"Four score and seven years ago") == 0x17770551


def test_the_fuzzer_finds_nothing_in_a_short_run(tmp_path: Path) -> None:
    assert "'accepted'" in short_fuzz_run("fuzz_hdf5.py", tmp_path, 8, 3, "--no-keras")


def test_a_link_name_holding_a_dot_or_percent_is_escaped_so_names_stay_apart(tmp_path: Path, mount: MountFn) -> None:
    source = tmp_path / "dots.h5"
    with h5py.File(source, "w") as file:
        file["a.b/c"] = np.full(2, 1, np.int8)  # a group named "a.b"
        file["a/b.c"] = np.full(2, 2, np.int8)  # a dataset named "b.c"
        file["a/b/c"] = np.full(2, 3, np.int8)
        file["100%/x"] = np.full(2, 4, np.int8)
    mnt = mount(str(source))
    header = json.loads(Path(mnt, "header.json").read_bytes())
    assert sorted(set(header) - {"__metadata__"}) == ["100%25.x", "a%2Eb.c", "a.b%2Ec", "a.b.c"]
    for name, value in (("a%2Eb.c", 1), ("a.b%2Ec", 2), ("a.b.c", 3), ("100%25.x", 4)):
        path = Path(mnt, "tensors", *(part.replace("%", "%25") for part in name.split(".")))
        assert path.read_bytes() == bytes([value, value]), name
        assert os.getxattr(path, "user.hdf5.name").decode() == name
