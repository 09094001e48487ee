"""The format contract: the same cases over every format stfs reads, as test_source_contract.py runs one suite over
every source. A format is one module of ``stfs/formats/`` (``formats.REGISTRY``); each case here holds for a file
its real writer made (safetensors, gguf-py's GGUFWriter, torch.save, onnx.save_model; the folder that
torch.distributed.checkpoint.save writes) through a real mount and the real commands: tensors, bytes, xattrs,
header.json, metadata/, views, info, check, check --values, diff (within a format and across formats), and refusal
in one line of a file cut short."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from stfs import formats
from tests.helpers import MountFn, refusal, stfs_command

Arrays = dict[str, np.ndarray]
Writer = Callable[[Path, Arrays], Path]


def write_safetensors(stem: Path, arrays: Arrays) -> Path:
    from safetensors.numpy import save_file

    path = stem.with_suffix(".safetensors")
    # safetensors stores an array's memory as it is: a Fortran-order one is given in C order, as its users must
    contiguous = {name: np.ascontiguousarray(array) for name, array in arrays.items()}
    save_file(contiguous, str(path), metadata={"note": "written by safetensors"})
    return path


def write_gguf(stem: Path, arrays: Arrays) -> Path:
    from tests.test_gguf_format import write

    tensors = {name: (array, None) for name, array in arrays.items()}
    return write(stem.with_suffix(".gguf"), tensors, general__name="contract")


def write_pytorch(stem: Path, arrays: Arrays) -> Path:
    import torch

    path = stem.with_suffix(".pt")
    torch.save({name: torch.from_numpy(kept(array)) for name, array in arrays.items()}, path)
    return path


def write_npz(stem: Path, arrays: Arrays) -> Path:
    path = stem.with_suffix(".npz")
    np.savez(path, **arrays)
    return path


def kept(array: np.ndarray) -> np.ndarray:
    """A writable copy in its own order: a Fortran-order array stays one (torch.from_numpy: a strided tensor)."""
    return np.array(array, order="K", copy=True)


def write_onnx(stem: Path, arrays: Arrays) -> Path:
    import onnx
    from onnx import helper, numpy_helper

    path = stem.with_suffix(".onnx")
    initializers = [numpy_helper.from_array(array, name) for name, array in arrays.items()]
    graph = helper.make_graph([], "contract", [], [], initializers)
    onnx.save_model(helper.make_model(graph, producer_name="contract"), str(path))
    return path


def write_dcp(stem: Path, arrays: Arrays) -> Path:
    """A folder (``.metadata``, ``__0_0.distcp``) as torch.distributed.checkpoint.save writes it in one process."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is disabled ...: assuming ... a single process"
        warnings.simplefilter("ignore")
        dcp.save({name: torch.from_numpy(kept(array)) for name, array in arrays.items()}, checkpoint_id=str(stem))
    return stem


def write_hdf5(stem: Path, arrays: Arrays) -> Path:
    """An h5py file: each tensor a dataset at the path its dots make (``model/layers/0/weight``), a file attribute."""
    import h5py

    path = stem.with_suffix(".h5")
    with h5py.File(path, "w") as file:
        file.attrs["note"] = "written by h5py"
        for name, array in arrays.items():
            file.create_dataset(name.replace(".", "/"), data=array)
    return path


WRITERS: dict[str, Writer] = {
    "safetensors": write_safetensors,
    "gguf": write_gguf,
    "pytorch": write_pytorch,
    "onnx": write_onnx,
    "dcp": write_dcp,
    "npz": write_npz,
    "hdf5": write_hdf5,
}


def test_every_registered_format_is_in_this_contract() -> None:
    assert [module for module, _, _ in formats.REGISTRY] == list(WRITERS)


def arrays(seed: int = 0) -> Arrays:
    rng = np.random.default_rng(seed)
    return {
        "model.layers.0.weight": rng.standard_normal((4, 8)).astype(np.float32),
        "model.layers.0.bias": rng.standard_normal(16).astype(np.float16),
        "model.norm": rng.standard_normal((2, 3, 4)).astype(np.float32),
        # a tensor whose bytes are not in C order where its writer keeps the order (torch.save, np.save): gathered
        "model.layers.1.weight": np.asfortranarray(rng.standard_normal((3, 5)).astype(np.float32)),
    }


@pytest.fixture(params=list(WRITERS))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def written(tmp_path: Path, kind: str, values: Arrays | None = None, stem: str = "model") -> Path:
    return WRITERS[kind](tmp_path / stem, arrays() if values is None else values)


def tensor_path(mnt: str, folder: str, name: str, suffix: str = "") -> Path:
    return Path(mnt, folder, *name.split(".")).with_name(name.split(".")[-1] + suffix)


def own_files(source: Path) -> list[Path]:
    """The files a writer wrote: the source, or those of the folder it is (a DCP)."""
    return sorted(source.iterdir()) if source.is_dir() else [source]


def one_line(result: subprocess.CompletedProcess, source: Path) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert str(source) in lines[0] and "Traceback" not in result.stderr
    return lines[0]


def test_every_tensor_is_a_file_of_its_bytes(tmp_path: Path, kind: str, mount: MountFn) -> None:
    source = written(tmp_path, kind)
    mnt = mount(str(source))
    namespace = formats.named(kind).name
    for name, array in arrays().items():
        path = tensor_path(mnt, "tensors", name)
        assert path.read_bytes() == array.tobytes(), name
        assert os.stat(path).st_size == array.nbytes
        assert os.getxattr(path, f"user.{namespace}.name").decode() == name
        assert json.loads(os.getxattr(path, f"user.{namespace}.shape")) == list(array.shape)
        file = Path(os.getxattr(path, f"user.{namespace}.file").decode())
        assert file in own_files(source)
        offset = int(os.getxattr(path, f"user.{namespace}.offset"))
        with open(file, "rb") as stream:  # each of these writers stores a tensor's bytes at its offset (in its order)
            stream.seek(offset)
            assert stream.read(array.nbytes) in (array.tobytes(order="C"), array.tobytes(order="F"))
    assert sorted(p.name for p in Path(mnt, "files").iterdir()) == [file.name for file in own_files(source)]
    for file in own_files(source):
        assert Path(mnt, "files", file.name).read_bytes() == file.read_bytes()


def test_header_json_is_in_the_safetensors_schema_and_metadata_has_a_file_per_key(
    tmp_path: Path, kind: str, mount: MountFn
) -> None:
    mnt = mount(str(written(tmp_path, kind)))
    header = json.loads(Path(mnt, "header.json").read_bytes())
    metadata = header.pop("__metadata__")
    assert set(header) == set(arrays())
    for name, array in arrays().items():
        entry = header[name]
        assert entry["shape"] == list(array.shape)
        assert entry["dtype"] == {"float32": "F32", "float16": "F16"}[str(array.dtype)]
        begin, end = entry["data_offsets"]
        assert end - begin == array.nbytes
    assert metadata and sorted(os.listdir(Path(mnt, "metadata"))) == sorted(metadata)
    for key, value in metadata.items():
        if isinstance(value, str):
            assert Path(mnt, "metadata", key).read_text() == value + "\n"


def test_views_decode_every_format_alike(tmp_path: Path, kind: str, mount: MountFn) -> None:
    mnt = mount(str(written(tmp_path, kind)), options=["view=f32", "view=npy", "view=stats"])
    for name, array in arrays().items():
        assert tensor_path(mnt, "f32", name).read_bytes() == array.astype(np.float32).tobytes()
        loaded = np.load(tensor_path(mnt, "npy", name, ".npy"))
        assert loaded.dtype == array.dtype and np.array_equal(loaded, array)
        stats = json.loads(tensor_path(mnt, "stats", name, ".json").read_bytes())
        assert stats["count"] == array.size and stats["max"] == float(array.max())


def test_info_and_check_read_the_header(tmp_path: Path, kind: str) -> None:
    source = written(tmp_path, kind)
    info = stfs_command("info", "--json", str(source))
    assert info.returncode == 0, info.stderr
    tensors = {tensor["name"]: tensor for tensor in json.loads(info.stdout)["models"][0]["tensors"]}
    assert {name: tensors[name]["shape"] for name in tensors} == {n: list(a.shape) for n, a in arrays().items()}
    check = stfs_command("check", str(source))
    assert check.returncode == 0 and f"ok ({len(arrays())} tensors)" in check.stdout, check.stdout + check.stderr


def test_check_values_names_a_nan(tmp_path: Path, kind: str) -> None:
    values = arrays()
    values["model.norm"][1, 2, 3] = np.nan
    source = written(tmp_path, kind, values)
    result = stfs_command("check", "--values", str(source))
    assert result.returncode == 1
    assert "'model.norm': 1 NaN, 0 +inf, 0 -inf, the first at [1, 2, 3]" in result.stdout


def test_diff_finds_one_changed_value(tmp_path: Path, kind: str) -> None:
    a = written(tmp_path, kind, stem="a")
    same = written(tmp_path, kind, stem="same")
    changed = arrays()
    changed["model.layers.0.weight"][3, 5] += 1
    b = written(tmp_path, kind, changed, stem="b")
    assert stfs_command("diff", str(a), str(same)).returncode == 0
    result = stfs_command("diff", "--json", str(a), str(b))
    assert result.returncode == 1
    found = {tensor["name"]: tensor for tensor in json.loads(result.stdout)["tensors"]}
    assert found["model.layers.0.weight"]["status"] == "different"
    assert found["model.layers.0.weight"]["where"] == [3, 5] and found["model.layers.0.weight"]["differ"] == 1
    assert {found[name]["status"] for name in ("model.layers.0.bias", "model.norm")} == {"identical"}


def test_the_same_tensors_in_any_two_formats_are_equal(tmp_path: Path) -> None:
    sources = [write(tmp_path / kind, arrays()) for kind, write in WRITERS.items()]
    for a, b in zip(sources, sources[1:] + sources[:1], strict=True):
        result = stfs_command("diff", str(a), str(b))
        assert result.returncode == 0, f"{a.name} {b.name}: {result.stdout}{result.stderr}"


@pytest.mark.parametrize("cut", ["header", "data"])
def test_a_file_cut_short_is_refused_in_one_line(tmp_path: Path, kind: str, cut: str, require_fuse: None) -> None:
    source = written(tmp_path, kind)
    files = own_files(source)  # of a folder (a DCP), its header (.metadata, named first) or its largest file
    target = files[0] if cut == "header" else max(files, key=lambda file: file.stat().st_size)
    data = target.read_bytes()
    target.write_bytes(data[:24] if cut == "header" else data[: len(data) - 100])
    result = refusal(source, tmp_path)
    assert result.returncode == 1
    one_line(result, source)
    check = stfs_command("check", str(source))
    assert check.returncode == 1 and str(source) in check.stdout + check.stderr


def every_title() -> str:
    """The formats stfs reads as a message lists them: every ``Format.title`` in ``formats.REGISTRY``'s order."""
    titles = [formats.named(module).title for module, _, _ in formats.REGISTRY]
    return ", ".join(titles[:-1]) + " or " + titles[-1]


def no_format_file(source: Path) -> Path:
    if source.suffix == ".tflite":
        source.write_bytes(b"\x1c\x00\x00\x00TFL3" + bytes(64))  # a TensorFlow Lite flatbuffer
    else:  # a zip of notes: a zip-based format's sniff looks at its members, not at the zip's signature alone
        import zipfile

        with zipfile.ZipFile(source, "w") as archive:
            archive.writestr("notes/readme.txt", "not a model")
    return source


@pytest.mark.parametrize("name", ["model.tflite", "notes.zip"])
def test_a_file_of_no_format_names_the_formats_stfs_reads(tmp_path: Path, require_fuse: None, name: str) -> None:
    source = no_format_file(tmp_path / name)
    result = refusal(source, tmp_path)
    assert result.returncode == 1
    line = one_line(result, source)
    assert f"not a model stfs reads (a {every_title()} file)" in line and "rule" not in line
