"""The format contract: the same cases over every format stfs reads, as test_source_contract.py runs one suite over
every source. A format is one module of ``stfs/formats/`` (``formats.REGISTRY``); each case here holds for a file
its real writer made (safetensors, gguf-py's GGUFWriter, torch.save, onnx.save_model; the folder that
torch.distributed.checkpoint.save writes) through a real mount and the real commands: tensors, bytes, xattrs,
header.json, metadata/, views, info, check, check --values, diff (within a format and across formats), and refusal
in one line of a file cut short."""

from __future__ import annotations

import ast
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    torch.save({name: as_torch(array) for name, array in arrays.items()}, path)
    return path


def write_npz(stem: Path, arrays: Arrays) -> Path:
    path = stem.with_suffix(".npz")
    np.savez(path, **arrays)
    return path


def kept(array: np.ndarray) -> np.ndarray:
    """A writable copy in its own order: a Fortran-order array stays one (torch.from_numpy: a strided tensor)."""
    return np.array(array, order="K", copy=True)


def as_torch(array: np.ndarray) -> Any:
    """``array`` as a torch tensor, in its own order; an ml_dtypes array (bfloat16, float8) as torch's dtype of that
    name, which torch.from_numpy does not know."""
    import torch

    kind = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
    if array.dtype.name in kind:
        return torch.from_numpy(kept(array).view(f"u{array.itemsize}")).view(kind[array.dtype.name])
    return torch.from_numpy(kept(array))


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

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is disabled ...: assuming ... a single process"
        warnings.simplefilter("ignore")
        dcp.save({name: as_torch(array) for name, array in arrays.items()}, checkpoint_id=str(stem))
    return stem


def write_flax(stem: Path, arrays: Arrays) -> Path:
    """A state dict nested by the dots of each name, as flax.serialization.to_bytes writes it."""
    from flax.serialization import to_bytes

    tree: dict[str, Any] = {}
    for name, array in arrays.items():
        *folders, leaf = name.split(".")
        node = tree
        for folder in folders:
            node = node.setdefault(folder, {})
        node[leaf] = array
    path = stem.with_suffix(".msgpack")
    path.write_bytes(to_bytes(tree))
    return path


_DEEPSPEED_WRITTEN: dict[str, Path] = {}


def write_deepspeed(stem: Path, arrays: Arrays) -> Path:
    """A ZeRO-2 tag folder as DeepSpeed's ``engine.save_checkpoint`` writes it from one rank (tests/deepspeed_write.py,
    a process of its own): float32 arrays as trained parameters, the others as buffers. A DeepSpeed process takes
    seconds: each set of arrays is written once a session, copied for each further use."""
    import hashlib
    import importlib.util
    import shutil
    import socket
    import sys

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)")
    if not any(array.dtype == np.float32 for array in arrays.values()):
        # DeepSpeed trains float32 masters and refuses a model with none; buffers of other dtypes beside them are
        # tests/test_deepspeed.py's (a DeepSpeed run per dtype here would cost minutes)
        raise ValueError("a DeepSpeed run needs a float32 parameter")
    digest = hashlib.sha256()
    for name, array in arrays.items():
        digest.update(f"{name}{array.dtype.str}{array.shape}".encode() + array.tobytes(order="A"))
    key = digest.hexdigest()
    if key not in _DEEPSPEED_WRITTEN:
        run = stem.with_name(stem.name + ".run")
        run.mkdir()
        np.savez(run / "arrays.npz", **arrays)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        script = Path(__file__).with_name("deepspeed_write.py")
        done = subprocess.run(
            [sys.executable, str(script), str(run / "arrays.npz"), str(run)], env=env, capture_output=True, timeout=240
        )
        assert done.returncode == 0, done.stderr[-3000:]
        _DEEPSPEED_WRITTEN[key] = run / "contract"
    shutil.copytree(_DEEPSPEED_WRITTEN[key], stem)
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
    "flax": write_flax,
    "deepspeed": write_deepspeed,
    "hdf5": write_hdf5,
}


def format_modules(package: Path = Path(formats.__file__).parent) -> list[str]:
    """The modules (or packages) of ``package`` that define a ``FORMAT``: the formats written, registered or not."""
    found = []
    for path in sorted(package.iterdir()):
        source = path / "__init__.py" if path.is_dir() else path
        if source.suffix == ".py" and source.exists():
            tree = ast.parse(source.read_text())
            assigned = [
                node.targets if isinstance(node, ast.Assign) else [node.target]
                for node in tree.body
                if isinstance(node, (ast.Assign, ast.AnnAssign))
            ]
            if any(isinstance(t, ast.Name) and t.id == "FORMAT" for targets in assigned for t in targets):
                found.append(path.stem)
    return found


def test_every_format_is_registered_and_in_this_contract(tmp_path: Path) -> None:
    """A format module without its REGISTRY line, or a REGISTRY line without a writer here, fails (issue #52: forgetting
    both passed every test)."""
    registered = [module for module, _, _ in formats.REGISTRY]
    assert sorted(format_modules()) == sorted(registered), "a format module of stfs/formats is not in REGISTRY"
    assert [name for name in registered if name not in WRITERS] == [], "a format without its writer in WRITERS"
    assert list(WRITERS) == registered, "WRITERS is not in REGISTRY's order"
    (tmp_path / "newformat").mkdir()  # the scan finds a format a contributor forgot to register, module or package
    (tmp_path / "newformat" / "__init__.py").write_text("from .x import Y\n\nFORMAT = Y()\n")
    (tmp_path / "other.py").write_text("FORMAT: Format = Other()\n")
    (tmp_path / "helper.py").write_text("def f() -> None:\n    FORMAT = 1\n")
    assert format_modules(tmp_path) == ["newformat", "other"]


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


# numpy's dtypes (ml_dtypes' for BF16 and F8) and the safetensors dtype each is, for the dtypes test below
NUMPY_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


SERVED_AT_LEAST = {"deepspeed": {"F32"}}


def test_every_dtype_a_format_emits_is_one_stfs_knows_with_its_bytes(tmp_path: Path, kind: str) -> None:
    """Each numpy dtype its writer writes, a file of its own: the format names it as safetensors does (the seam refuses
    any other name as the format's bug) and serves its bytes, or refuses the file by a rule of its own in one line."""
    import ml_dtypes

    from stfs import errors, model
    from stfs.nodes import read_into
    from stfs.sources import LocalFiles
    from stfs.views import build_tree

    served, refused = [], []
    for name, numpy_name in NUMPY_DTYPES.items():
        dtype = np.dtype(getattr(ml_dtypes, numpy_name, numpy_name))
        array = (np.arange(12) % 3).astype(dtype).reshape(3, 4)
        try:
            source = WRITERS[kind](tmp_path / name, {"t": array})
        except (TypeError, ValueError):  # a dtype its writer does not write
            continue
        try:  # the seam's errors.FormatBug is no FormatError: it fails the test
            loaded = model.load(model.discover(str(source))[0])
        except errors.FormatError as exc:  # a file of the dtype its format does not serve (a bfloat16 .npy is 'V2')
            assert str(source) in exc.message and "\n" not in exc.message
            refused.append(name)
            continue
        [entry] = loaded.shards[0].header.tensors
        assert entry.dtype == name
        node = build_tree([loaded]).lookup("/tensors/t")
        files = LocalFiles()
        try:
            buffer = bytearray(array.nbytes)
            read_into(node, 0, memoryview(buffer), files.read_into)  # type: ignore[arg-type]
        finally:
            files.close()
        assert bytes(buffer) == array.tobytes(), name
        served.append(name)
    # what every writer writes, every format serves (a DeepSpeed run's weights are its float32 masters)
    assert SERVED_AT_LEAST.get(kind, {"I8", "I16", "F16", "I32", "F32", "F64", "I64"}) <= set(served), (served, refused)


def test_a_tensor_ending_past_its_file_is_refused_by_its_format(tmp_path: Path, kind: str) -> None:
    """The file holding the tensor that ends last, cut inside that tensor: its format refuses it by a rule of its own
    (or, a tensor of another file, stfs's data-file rule), naming the file: never the seam's bug line, never served."""
    from stfs import errors, model

    source = written(tmp_path, kind)
    loaded = model.load(model.discover(str(source))[0])
    header = loaded.shards[0].header
    folder = Path(header.path).parent
    last = max(header.tensors, key=lambda entry: entry.end if entry.scattered is None else 0)
    target = Path(header.path) if last.file is None else folder / last.file
    with open(target, "r+b") as stream:
        stream.truncate(header.data_start * (last.file is None) + last.end - 4)
    with pytest.raises(errors.FormatError) as caught:  # not the seam's errors.FormatBug, which is no FormatError
        model.load(model.discover(str(source))[0])
    assert str(source) in caught.value.message and "\n" not in caught.value.message
