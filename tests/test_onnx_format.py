"""ONNX models (SPEC §13): models written by the real ``onnx`` package (``numpy_helper.from_array``,
``helper.make_tensor``'s typed fields, ``onnx.save_model`` with external data, a ``Constant`` node, ``If`` and
``Loop`` subgraphs), every tensor read through a real mount and compared with ``numpy_helper.to_array``; the
refusals, each one line naming the file, the tensor and the rule; diff against safetensors, info, check; memory
and wire costs that do not grow with the embedded weights."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stfs import errors
from stfs.formats import onnx as onnx_format
from tests.helpers import REPO, MountFn, refusal, run, stfs_command

onnx = pytest.importorskip("onnx")
ml_dtypes = pytest.importorskip("ml_dtypes")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

pytestmark = pytest.mark.timeout(180)

MIB = 1 << 20


def from_numpy() -> dict[str, np.ndarray]:
    """One array of each dtype ``numpy_helper.from_array`` stores in ``raw_data`` and safetensors has."""
    rng = np.random.default_rng(7)
    values = rng.standard_normal(24).astype(np.float32) * 3
    found = {
        "model.embed.weight": values.reshape(4, 6),
        "model.half": values[:6].astype(np.float16),
        "model.double": values[:5].astype(np.float64),
        "model.complex": (values[:4] + 1j * values[4:8]).astype(np.complex64),
        "ints.i8": np.arange(-4, 4, dtype=np.int8),
        "ints.u8": np.arange(8, dtype=np.uint8),
        "ints.i16": np.arange(-3, 3, dtype=np.int16),
        "ints.u16": np.arange(6, dtype=np.uint16),
        "ints.i32": np.arange(-2, 4, dtype=np.int32).reshape(2, 3),
        "ints.u32": np.arange(6, dtype=np.uint32),
        "ints.i64": np.arange(-3, 3, dtype=np.int64),
        "ints.u64": np.array([0, 2**63, 2**64 - 1], dtype=np.uint64),
        "flags": np.array([True, False, True]),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
        found[f"low.{name}"] = np.abs(values[:8]).astype(getattr(ml_dtypes, name))
    found["low.float4_e2m1fn"] = values[:8].astype(ml_dtypes.float4_e2m1fn)  # packed two a byte
    found["low.float6_e2m3fn"] = values[:8].astype(ml_dtypes.float6_e2m3fn)  # packed four in three bytes
    return found


def typed() -> list[Any]:
    """Tensors in typed fields, as ``helper.make_tensor`` writes them without ``raw=True``."""
    return [
        helper.make_tensor("typed.float", TensorProto.FLOAT, [2, 2], [1.0, -2.0, 3.5, 4.0]),  # one packed run
        helper.make_tensor("typed.double", TensorProto.DOUBLE, [3], [1.5, -2.0, 1e300]),
        helper.make_tensor("typed.half", TensorProto.FLOAT16, [3], [1.0, -2.0, 0.5]),
        helper.make_tensor("typed.bf16", TensorProto.BFLOAT16, [2], [1.0, -3.0]),
        helper.make_tensor("typed.i8", TensorProto.INT8, [3], [1, -2, 127]),
        helper.make_tensor("typed.u16", TensorProto.UINT16, [2], [1, 65535]),
        helper.make_tensor("typed.bool", TensorProto.BOOL, [3], [True, False, True]),
        helper.make_tensor("typed.i64", TensorProto.INT64, [3], [1, -2, 2**62]),
        helper.make_tensor("typed.u32", TensorProto.UINT32, [2], [1, 2**32 - 1]),
        helper.make_tensor("typed.u64", TensorProto.UINT64, [2], [1, 2**64 - 1]),
        helper.make_tensor("typed.complex", TensorProto.COMPLEX64, [2], [1 + 2j, -3j]),
        helper.make_tensor("typed.f8", TensorProto.FLOAT8E4M3FN, [2], [1.0, -2.0]),
        helper.make_tensor("typed.f4", TensorProto.FLOAT4E2M1, [4], [1.0, 2.0, -0.5, 6.0]),
        helper.make_tensor("typed.f6", TensorProto.FLOAT6E2M3, [4], [1.0, 2.0, -0.5, 3.0]),
    ]


LEFT_OUT = {"words": "STRING", "nibbles": "INT4", "wide": "COMPLEX128"}


def left_out() -> list[Any]:
    return [
        helper.make_tensor("words", TensorProto.STRING, [2], [b"a", b"b"]),
        helper.make_tensor("nibbles", TensorProto.INT4, [4], [1, -2, 3, 4]),
        numpy_helper.from_array(np.array([1 + 1j], dtype=np.complex128), "wide"),
    ]


def value_info(name: str, kind: int = TensorProto.FLOAT, shape: list[int] | None = None) -> Any:
    return helper.make_tensor_value_info(name, kind, shape)


def rich_model() -> Any:
    """Initializers of every dtype, typed fields, a ``Constant`` node, an ``If`` whose branches and a ``Loop`` whose
    body hold initializers of their own (the ``Loop`` inside the ``then`` branch: subgraphs nest)."""
    initializers = [numpy_helper.from_array(array, name) for name, array in from_numpy().items()]
    constant = helper.make_node(
        "Constant", [], ["const.k"], value=numpy_helper.from_array(np.arange(6, dtype=np.int32).reshape(2, 3), "kv")
    )
    body = helper.make_graph(
        [helper.make_node("Identity", ["loop.c"], ["loop.out"])],
        "body",
        [value_info("i", TensorProto.INT64), value_info("cond_in", TensorProto.BOOL)],
        [value_info("cond_in", TensorProto.BOOL), value_info("loop.out")],
        [numpy_helper.from_array(np.full(3, 9, dtype=np.float32), "loop.c")],
    )
    loop = helper.make_node("Loop", ["", "cond"], ["loop.result"], body=body)
    then_branch = helper.make_graph(
        [loop, helper.make_node("Identity", ["then.c"], ["y"])],
        "then",
        [],
        [value_info("y")],
        [numpy_helper.from_array(np.array([5, 6], np.float32), "then.c")],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Identity", ["else.c"], ["y2"])],
        "else",
        [],
        [value_info("y2")],
        [numpy_helper.from_array(np.array([7, 8], np.float32), "else.c")],
    )
    branch = helper.make_node("If", ["cond"], ["out"], then_branch=then_branch, else_branch=else_branch)
    graph = helper.make_graph(
        [constant, branch],
        "rich",
        [value_info("cond", TensorProto.BOOL)],
        [value_info("out")],
        initializers + typed() + left_out(),
    )
    model = helper.make_model(
        graph,
        producer_name="stfs-tests",
        producer_version="1.0",
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    helper.set_model_props(model, {"author": "the tests", "license": "MIT"})
    return model


def every_tensor(graph: Any) -> Iterator[tuple[str, Any]]:
    """Every tensor of ``graph`` as the onnx package sees it: initializers, ``Constant`` values (by their output)
    and the same of every subgraph."""
    for tensor in graph.initializer:
        yield tensor.name, tensor
    for node in graph.node:
        for attribute in node.attribute:
            if node.op_type == "Constant" and attribute.name == "value":
                yield node.output[0], attribute.t
            for inner in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                yield from every_tensor(inner)


def expected(model: Any, base: Path | None = None) -> dict[str, np.ndarray]:
    return {
        name: numpy_helper.to_array(tensor, str(base or ""))
        for name, tensor in every_tensor(model.graph)
        if name not in LEFT_OUT
    }


PACKED = {"FLOAT4E2M1", "FLOAT6E2M3", "FLOAT6E3M2"}


def check_mount(mnt: str, wanted: dict[str, np.ndarray], model: Any) -> None:
    """Each tensor's file holds ``to_array``'s bytes (F4, F6: its values, packed as safetensors packs them), with
    its xattrs."""
    types = {name: TensorProto.DataType.Name(tensor.data_type) for name, tensor in every_tensor(model.graph)}
    for name, array in wanted.items():
        path = Path(mnt, "tensors", *name.split("."))
        assert os.getxattr(path, "user.onnx.name").decode() == name
        assert os.getxattr(path, "user.onnx.data_type").decode() == types[name]
        assert json.loads(os.getxattr(path, "user.onnx.shape")) == list(array.shape)
        if types[name] in PACKED:
            decoded = np.fromfile(Path(mnt, "f32", *name.split(".")), dtype=np.float32)
            assert np.array_equal(decoded, array.astype(np.float32).reshape(-1)), name
            assert path.stat().st_size == array.size * (4 if types[name] == "FLOAT4E2M1" else 6) // 8
        else:
            assert path.read_bytes() == array.tobytes(), name


def test_every_tensor_of_a_model_is_a_file_of_to_arrays_bytes(tmp_path: Path, mount: MountFn) -> None:
    model = rich_model()
    source = tmp_path / "model.onnx"
    onnx.save_model(model, str(source))
    mnt = mount(str(source), options=["view=f32"])

    wanted = expected(model)
    assert {"const.k", "then.c", "else.c", "loop.c", "typed.half", "low.float4_e2m1fn"} <= set(wanted)
    check_mount(mnt, wanted, model)
    header = json.loads(Path(mnt, "header.json").read_bytes())
    assert list(header) == ["__metadata__", *[name for name in header if name != "__metadata__"]]
    assert set(header) - {"__metadata__"} == set(wanted)
    assert header["low.bfloat16"]["dtype"] == "BF16" and header["typed.f4"]["dtype"] == "F4"
    metadata = {name: Path(mnt, "metadata", name).read_text() for name in os.listdir(Path(mnt, "metadata"))}
    assert metadata == {
        "ir_version": f"{model.ir_version}\n",
        "producer_name": "stfs-tests\n",
        "producer_version": "1.0\n",
        "opset.ai.onnx": "17\n",
        "opset.com.microsoft": "1\n",
        "author": "the tests\n",
        "license": "MIT\n",
    }
    assert header["__metadata__"] == {key: value[:-1] for key, value in metadata.items()}
    embedded = Path(mnt, "tensors", "model", "embed", "weight")
    offset = int(os.getxattr(embedded, "user.onnx.offset"))
    assert source.read_bytes()[offset : offset + 96] == wanted["model.embed.weight"].tobytes()
    assert os.getxattr(embedded, "user.onnx.file").decode() == str(source)
    assert "user.onnx.location" not in os.listxattr(embedded)


def test_tensors_of_a_type_safetensors_lacks_are_left_out_with_a_warning(tmp_path: Path) -> None:
    source = tmp_path / "model.onnx"
    onnx.save_model(rich_model(), str(source))
    result = stfs_command("check", str(source))
    assert result.returncode == 0, result.stdout + result.stderr
    for name, kind in LEFT_OUT.items():
        assert f"tensor {name!r} is left out: its data_type {kind} has no safetensors dtype" in result.stdout
    assert f"ok ({len(expected(rich_model()))} tensors)" in result.stdout


@pytest.mark.parametrize("one_file", [True, False], ids=["one-data-file", "a-file-per-tensor"])
def test_external_data_is_served_from_its_files(tmp_path: Path, mount: MountFn, one_file: bool) -> None:
    model = rich_model()
    folder = tmp_path / "exported"
    (folder / "weights").mkdir(parents=True)
    source = folder / "model.onnx"
    onnx.save_model(
        model,
        str(source),
        save_as_external_data=True,
        all_tensors_to_one_file=one_file,
        location="weights/model.onnx.data" if one_file else None,
        size_threshold=16,
    )
    saved = onnx.load(str(source), load_external_data=False)
    external = {name for name, tensor in every_tensor(saved.graph) if tensor.data_location == TensorProto.EXTERNAL}
    assert "model.embed.weight" in external and "typed.half" not in external  # small ones stay in the model

    mnt = mount(str(source), options=["view=f32"])
    check_mount(mnt, expected(onnx.load(str(source))), model)
    weight = Path(mnt, "tensors", "model", "embed", "weight")
    location = os.getxattr(weight, "user.onnx.location").decode()
    data_file = folder / location
    assert os.getxattr(weight, "user.onnx.file").decode() == str(data_file)
    offset = int(os.getxattr(weight, "user.onnx.offset"))
    assert data_file.read_bytes()[offset : offset + 96] == from_numpy()["model.embed.weight"].tobytes()
    on_disk = sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())
    files = sorted(
        str(path.relative_to(Path(mnt, "files"))) for path in Path(mnt, "files").rglob("*") if path.is_file()
    )
    assert files == on_disk and len(files) > 1
    assert Path(mnt, "files", location).read_bytes() == data_file.read_bytes()
    loaded = onnx.load(str(Path(mnt, "files", "model.onnx")))  # the onnx package loads it through the mount
    assert {name: a.tobytes() for name, a in expected(loaded).items()} == {
        name: a.tobytes() for name, a in expected(onnx.load(str(source))).items()
    }

    folder_mnt = mount(str(folder))  # the folder: one model, its data files not models of their own
    assert Path(folder_mnt, "tensors", "model", "embed", "weight").read_bytes() == weight.read_bytes()


def test_diff_against_the_safetensors_file_of_the_same_tensors_is_0(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    arrays = {name: a for name, a in from_numpy().items() if not name.startswith("low.") and name != "empty"}
    graph = helper.make_graph([], "same", [], [], [numpy_helper.from_array(a, n) for n, a in arrays.items()])
    embedded, external = tmp_path / "embedded.onnx", tmp_path / "external" / "model.onnx"
    external.parent.mkdir()
    onnx.save_model(helper.make_model(graph), str(embedded))
    onnx.save_model(helper.make_model(graph), str(external), save_as_external_data=True, size_threshold=0)
    reference = tmp_path / "model.safetensors"
    save_file(arrays, str(reference))
    for source in (embedded, external):
        result = stfs_command("diff", str(source), str(reference))
        assert result.returncode == 0, result.stdout + result.stderr
    arrays["model.embed.weight"] = arrays["model.embed.weight"].copy()
    arrays["model.embed.weight"][1, 2] += 1
    save_file(arrays, str(reference))
    changed = stfs_command("diff", "--json", str(external), str(reference))
    assert changed.returncode == 1
    report = {entry["name"]: entry for entry in json.loads(changed.stdout)["tensors"]}
    assert report["model.embed.weight"]["where"] == [1, 2] and report["model.embed.weight"]["differ"] == 1


def test_info_check_and_check_values_read_external_data(tmp_path: Path) -> None:
    weights = np.ones((8, 8), dtype=np.float32)
    weights[3, 4] = np.inf
    graph = helper.make_graph([], "g", [], [], [numpy_helper.from_array(weights, "w")])
    source = tmp_path / "model.onnx"
    onnx.save_model(
        helper.make_model(graph), str(source), save_as_external_data=True, location="model.onnx.data", size_threshold=0
    )
    info = stfs_command("info", "--json", str(source))
    assert info.returncode == 0, info.stderr
    (tensor,) = json.loads(info.stdout)["models"][0]["tensors"]
    assert tensor["file"] == str(tmp_path / "model.onnx.data") and tensor["shape"] == [8, 8]
    assert stfs_command("check", str(source)).returncode == 0
    values = stfs_command("check", "--values", str(source))
    assert values.returncode == 1
    assert f"{tmp_path / 'model.onnx.data'}: tensor 'w': 0 NaN, 1 +inf, 0 -inf, the first at [3, 4]" in values.stdout


def test_the_safetensors_view_converts_a_model(tmp_path: Path, mount: MountFn) -> None:
    from safetensors.numpy import load_file

    arrays = {name: a for name, a in from_numpy().items() if not name.startswith("low.")}
    graph = helper.make_graph([], "g", [], [], [numpy_helper.from_array(a, n) for n, a in arrays.items()] + typed()[:3])
    source = tmp_path / "model.onnx"
    onnx.save_model(
        helper.make_model(graph), str(source), save_as_external_data=True, location="model.onnx.data", size_threshold=64
    )
    mnt = mount(str(source), options=["view=safetensors"])
    assert sorted(os.listdir(Path(mnt, "safetensors"))) == ["model.onnx.data", "model.safetensors"]
    loaded = load_file(str(Path(mnt, "safetensors", "model.safetensors")))
    wanted = expected(onnx.load(str(source)))
    assert set(loaded) == set(wanted)
    for name, array in wanted.items():
        assert loaded[name].tobytes() == array.tobytes(), name


def test_names_met_twice_keep_the_first(tmp_path: Path, mount: MountFn) -> None:
    """onnx's checker lets two sibling subgraphs hold initializers of one name: the first the file holds is served."""
    branches = [
        helper.make_graph(
            [helper.make_node("Identity", ["c"], [out])],
            out,
            [],
            [value_info(out, shape=[2])],
            [numpy_helper.from_array(np.full(2, k, np.float32), "c")],
        )
        for k, out in ((1, "y"), (2, "z"))
    ]
    node = helper.make_node("If", ["cond"], ["out"], then_branch=branches[0], else_branch=branches[1])
    graph = helper.make_graph([node], "g", [value_info("cond", TensorProto.BOOL, [])], [value_info("out", shape=[2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    source = tmp_path / "model.onnx"
    onnx.save_model(model, str(source))
    check = stfs_command("check", str(source))
    assert "tensor 'c' is left out: an earlier tensor of the model has its name" in check.stdout
    first = next(tensor for name, tensor in every_tensor(model.graph) if name == "c")  # as the file holds them
    mnt = mount(str(source))
    assert Path(mnt, "tensors", "c").read_bytes() == numpy_helper.to_array(first).tobytes()


def test_a_model_named_otherwise_is_known_by_its_first_bytes(tmp_path: Path) -> None:
    source = tmp_path / "weights.pb"
    onnx.save_model(rich_model(), str(source))
    result = stfs_command("info", "--json", str(source))
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["models"][0]["tensors"]) == len(expected(rich_model()))


# -- refused in one line ---------------------------------------------------------------------------------------------


def external_model(folder: Path, **info: str) -> Path:
    """A model whose tensor ``w`` (4 float32) is external data described by ``info`` (``location`` ...)."""
    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    for key, value in info.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph([], "g", [], [], [tensor])
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "model.onnx"
    source.write_bytes(helper.make_model(graph).SerializeToString())
    return source


def refused(source: Path, tmp_path: Path) -> str:
    """The one line ``stfs mount`` and ``stfs check`` refuse ``source`` with (nothing mounted)."""
    result = refusal(source, tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert str(source) in lines[0]
    check = stfs_command("check", str(source))
    assert check.returncode == 1 and lines[0].removeprefix("stfs: ") in check.stdout + check.stderr
    return lines[0]


def test_a_location_outside_the_folder_is_refused(tmp_path: Path, require_fuse: None) -> None:
    (tmp_path / "secret.bin").write_bytes(bytes(16))
    for location in ("../secret.bin", str(tmp_path / "secret.bin"), "sub/../../secret.bin"):
        line = refused(external_model(tmp_path / "model", location=location), tmp_path)
        assert "tensor 'w'" in line and "LocationOutsideFolder" in line and repr(location) in line


def test_a_missing_or_short_data_file_is_refused(tmp_path: Path, require_fuse: None) -> None:
    source = external_model(tmp_path / "model", location="w.bin")
    line = refused(source, tmp_path)
    assert "tensor 'w'" in line and "MissingDataFile" in line and "'w.bin'" in line
    (tmp_path / "model" / "w.bin").write_bytes(bytes(20))
    source = external_model(tmp_path / "model", location="w.bin", offset="8")
    line = refused(source, tmp_path)
    assert "DataFileTooShort" in line and "[8, 24) of 'w.bin', which is 20 bytes" in line
    source = external_model(tmp_path / "model", location="w.bin", offset="4", length="16")
    assert stfs_command("check", str(source)).returncode == 0


def test_a_length_that_is_not_dims_times_the_size_is_refused(tmp_path: Path, require_fuse: None) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "w.bin").write_bytes(bytes(64))
    line = refused(external_model(tmp_path / "model", location="w.bin", length="12"), tmp_path)
    assert "TensorLengthMismatch" in line and "length is 12; dims [4] of FLOAT need 16 bytes" in line

    for tensor, detail in [
        (TensorProto(name="r", data_type=TensorProto.FLOAT, dims=[3], raw_data=bytes(8)), "raw_data is 8 bytes"),
        (
            TensorProto(name="h", data_type=TensorProto.FLOAT16, dims=[3], int32_data=[1, 2]),
            "int32_data holds 2 values",
        ),
        (
            TensorProto(name="f", data_type=TensorProto.FLOAT, dims=[3], float_data=[1.0, 2.0]),
            "float_data holds 2 values",
        ),
        (TensorProto(name="n", data_type=TensorProto.INT64, dims=[2]), "int64_data holds 0 values"),
    ]:
        source = tmp_path / f"{tensor.name}.onnx"
        onnx.save_model(helper.make_model(helper.make_graph([], "g", [], [], [tensor])), str(source))
        line = refused(source, tmp_path)
        assert f"tensor {tensor.name!r}" in line and "TensorLengthMismatch" in line and detail in line


def test_an_unknown_data_type_is_refused(tmp_path: Path, require_fuse: None) -> None:
    for data_type in (99, 0):
        tensor = TensorProto()
        # field 8 (name) "u", field 1 (dims) 2, field 2 (data_type): a value TensorProto.DataType lacks
        tensor.MergeFromString(b"\x42\x01u\x08\x02\x10" + bytes([data_type]))
        source = tmp_path / f"model{data_type}.onnx"
        onnx.save_model(helper.make_model(helper.make_graph([], "g", [], [], [tensor])), str(source))
        line = refused(source, tmp_path)
        assert "tensor 'u'" in line and "UnknownDataType" in line and f"data_type {data_type}" in line


def test_a_truncated_protobuf_is_refused(tmp_path: Path, require_fuse: None) -> None:
    whole = tmp_path / "whole.onnx"
    onnx.save_model(rich_model(), str(whole))
    data = whole.read_bytes()
    source = tmp_path / "model.onnx"
    source.write_bytes(data[: len(data) // 2])
    line = refused(source, tmp_path)
    assert "TruncatedProtobuf" in line and "past the end of the file" in line


def test_every_cut_and_every_changed_byte_is_a_model_or_one_named_error() -> None:
    """No cut of a model, and no byte of it changed, makes the reader fail but in a named ``StfsError``."""
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.arange(3, dtype=np.int8)))],
            "g",
            [],
            [],
            [numpy_helper.from_array(np.ones(4, np.float32), "w"), helper.make_tensor("h", 10, [2], [1.0, 2.0])],
        )
    )
    data = model.SerializeToString()

    def read(blob: bytes) -> None:
        with contextlib.suppress(errors.StfsError):
            onnx_format.fetch_header(lambda o, s: blob[o : o + s], path="m.onnx", file_size=len(blob))

    whole = 0
    for cut in range(len(data)):
        try:
            onnx_format.fetch_header(lambda o, s, cut=cut: data[:cut][o : o + s], path="m.onnx", file_size=cut)
            whole += 1  # cut where a field of the ModelProto ends: a model with fewer fields
        except onnx_format.OnnxError:
            pass
    assert whole <= 3  # nothing; ir_version; ir_version and the graph
    for at in range(len(data)):
        for value in (0x00, 0x7F, 0x80, 0xFF, data[at] ^ 0x08):
            read(data[:at] + bytes([value]) + data[at + 1 :])


def test_tensors_in_typed_fields_past_the_bound_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Typed fields are made into bytes held in memory: past ``HELD_LIMIT`` (64 MiB; 64 bytes here) a model is
    refused, naming the tensor that crosses it. A packed ``float_data`` is a range of the file: never held."""
    graph = helper.make_graph(
        [],
        "g",
        [],
        [],
        [
            helper.make_tensor("floats", TensorProto.FLOAT, [32], [1.0] * 32),
            helper.make_tensor("first", TensorProto.FLOAT16, [16], [1.0] * 16),
            helper.make_tensor("second", TensorProto.FLOAT16, [16], [2.0] * 16),
        ],
    )
    data = helper.make_model(graph).SerializeToString()
    monkeypatch.setattr(onnx_format, "HELD_LIMIT", 64)
    with pytest.raises(onnx_format.TypedDataTooLarge) as refused:
        onnx_format.fetch_header(lambda o, s: data[o : o + s], path="m.onnx", file_size=len(data))
    assert refused.value.tensor == "second"
    monkeypatch.setattr(onnx_format, "HELD_LIMIT", 128)
    header = onnx_format.fetch_header(lambda o, s: data[o : o + s], path="m.onnx", file_size=len(data))
    assert [entry.held is not None for entry in header.tensors] == [False, True, True]


def nested_model(levels: int) -> bytes:
    """Loop bodies ``levels`` deep (graph, node, attribute: three messages a level) around an initializer ``w``,
    written field by field: onnx's own helper cannot nest them past protobuf's limit."""
    leaf = numpy_helper.from_array(np.ones(1, np.float32), "w").SerializeToString()
    graph = b"\x2a" + _varint(len(leaf)) + leaf  # GraphProto.initializer
    for _ in range(levels):
        attribute = b"\x0a\x04body" + b"\x32" + _varint(len(graph)) + graph  # AttributeProto name, g
        node = b"\x22\x04Loop" + b"\x2a" + _varint(len(attribute)) + attribute  # NodeProto op_type, attribute
        graph = b"\x0a" + _varint(len(node)) + node  # GraphProto.node
    return b"\x08\x08" + b"\x3a" + _varint(len(graph)) + graph  # ModelProto ir_version, graph


def test_subgraphs_nested_past_protobufs_limit_are_refused() -> None:
    deep = nested_model(40)
    with pytest.raises(onnx_format.InvalidProtobuf, match="nest more than 100 deep"):
        onnx_format.fetch_header(lambda o, s: deep[o : o + s], path="m.onnx", file_size=len(deep))
    data = nested_model(30)
    header = onnx_format.fetch_header(lambda o, s: data[o : o + s], path="m.onnx", file_size=len(data))
    assert [entry.name for entry in header.tensors] == ["w"]
    assert len(onnx.ModelProto.FromString(data).graph.node) == 1  # as the onnx package reads it too


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out) + bytes([value])


# -- bounded: memory, and the wire ------------------------------------------------------------------------------------


def big_model(path: Path, megabytes: int) -> int:
    """A model of ``megabytes`` MiB of float32 weights in 32 initializers, embedded as raw_data; its size."""
    per = megabytes * MIB // 32 // 4
    rng = np.random.default_rng(3)
    initializers = [
        numpy_helper.from_array(rng.standard_normal(per).astype(np.float32), f"layers.{i}.weight") for i in range(32)
    ]
    onnx.save_model(helper.make_model(helper.make_graph([], "big", [], [], initializers)), str(path))
    return path.stat().st_size


def peak_rss(*args: str) -> int:
    """The peak resident memory of ``stfs ARGS`` run alone, in bytes (its exit status 0)."""
    code = (
        "import resource, subprocess, sys; "
        "done = subprocess.run([sys.executable, '-m', 'stfs', *sys.argv[1:]], capture_output=True); "
        "assert done.returncode == 0, done.stderr; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)"
    )
    result = run([sys.executable, "-c", code, *args], cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


def test_info_of_a_model_with_embedded_weights_does_not_hold_them(tmp_path: Path) -> None:
    small = tmp_path / "small.onnx"
    onnx.save_model(rich_model(), str(small))
    big = tmp_path / "big.onnx"
    size = big_model(big, 96)
    grown = peak_rss("info", str(big)) - peak_rss("info", str(small))
    assert grown < size // 8, (grown, size)  # loading the model would take its size, twice over


def test_info_of_a_remote_model_reads_its_framing_not_its_weights(nginx: Any, tmp_path: Path) -> None:
    local = tmp_path / "model.onnx"
    size = big_model(local, 32)
    url = nginx.put("model.onnx", local.read_bytes())
    nginx.log.clear()
    result = run([sys.executable, "-m", "stfs", "info", url, "--json"])
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert len(document["models"][0]["tensors"]) == 32
    transfer = nginx.log.transfer()
    assert document["transfer"]["bytes"] == transfer.bytes
    assert transfer.requests <= 34 and transfer.bytes <= 100_000 + 33 * 2 * onnx_format.WINDOW < size // 50, transfer


# -- without the onnx package ----------------------------------------------------------------------------------------


def without_onnx(*args: str) -> subprocess.CompletedProcess:
    """``stfs ARGS`` in a Python where ``import onnx`` fails, as where the package is not installed."""
    code = "import sys; sys.modules['onnx'] = None; from stfs.cli import main; sys.exit(main(sys.argv[1:]))"
    return run([sys.executable, "-c", code, *args], cwd=Path(__file__).resolve().parent.parent)


def test_without_the_onnx_package_a_model_reads_as_with_it(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    source = tmp_path / "graph.onnx"
    onnx.save_model(rich_model(), str(source))
    result = without_onnx("info", "--json", str(source))
    assert result.returncode == 0, result.stderr
    assert result.stdout == stfs_command("info", "--json", str(source)).stdout
    save_file({"w": np.ones(3, np.float32)}, str(tmp_path / "model.safetensors"))
    folder = without_onnx("check", str(tmp_path))
    assert folder.returncode == 0 and folder.stdout.count(": ok (") == 2, folder.stdout + folder.stderr


def imported(stderr: str) -> set[str]:
    """The modules ``python -X importtime`` says were imported (by import statements: not importlib's)."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def modules_after(*args: str) -> set[str]:
    """``sys.modules`` once ``stfs ARGS`` has run in the process (exit status 0)."""
    code = (
        "import sys; from stfs.cli import main; status = main(sys.argv[1:]); "
        "print('modules:', *sorted(sys.modules), file=sys.stderr); sys.exit(status)"
    )
    result = run([sys.executable, "-c", code, *args], cwd=REPO)
    assert result.returncode == 0, result.stderr
    return set(result.stderr.splitlines()[-1].split()[1:])


def test_info_and_mount_import_neither_onnx_nor_protobuf(tmp_path: Path, require_fuse: None) -> None:
    """The mount and info paths read a model with stfs's own protobuf reader: ``onnx`` (1.9 s to import) and
    ``google.protobuf`` stay unimported; of a model of ``raw_data`` only, numpy too, as for a safetensors file."""
    source = tmp_path / "model.onnx"
    onnx.save_model(rich_model(), str(source))
    raw = tmp_path / "raw.onnx"
    onnx.save_model(helper.make_model(helper.make_graph([], "g", [], [], list(initializers_of_raw_data()))), str(raw))
    foreign = {"onnx", "google", "google.protobuf", "ml_dtypes"}
    for model, unwanted in ((source, foreign), (raw, foreign | {"numpy"})):
        for command in ("info", "check"):
            modules = modules_after(command, str(model))
            assert "stfs.formats.onnx" in modules
            assert not modules & unwanted, (command, model)

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    daemon = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "stfs", "mount", "-f", str(source), str(mnt)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not os.path.ismount(mnt) and daemon.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.path.ismount(mnt), daemon.stderr.read() if daemon.poll() is not None else "not mounted in 60 s"
        half = numpy_helper.to_array(next(t for t in rich_model().graph.initializer if t.name == "typed.half"))
        assert Path(mnt, "tensors", "typed", "half").read_bytes() == half.tobytes()
    finally:
        if os.path.ismount(mnt):
            stfs_command("unmount", str(mnt))
        try:
            _, stderr = daemon.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            _, stderr = daemon.communicate()
    assert "stfs._libfuse" in imported(stderr)
    assert not imported(stderr) & foreign


def initializers_of_raw_data() -> Iterator[Any]:
    for name, array in from_numpy().items():
        yield numpy_helper.from_array(array, name)


# -- every data_type, every storage, against to_array, without a mount ------------------------------------------------

# data_type -> the typed field to_array reads (helper.tensor_dtype_to_field), its number and how a value is written
FIELD_OF = {TensorProto.FLOAT: "float_data", TensorProto.COMPLEX64: "float_data", TensorProto.DOUBLE: "double_data"}
FIELD_OF |= {TensorProto.INT64: "int64_data", TensorProto.UINT32: "uint64_data", TensorProto.UINT64: "uint64_data"}
FIELDS = {
    "float_data": (4, 5),
    "int32_data": (5, 0),
    "int64_data": (7, 0),
    "double_data": (10, 1),
    "uint64_data": (11, 0),
}
SERVED = sorted(onnx_format.DTYPES)
NOT_SERVED = {TensorProto.STRING, TensorProto.COMPLEX128, TensorProto.INT4, TensorProto.UINT4, 25, 26}


def _tag(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _field(number: int, payload: bytes) -> bytes:
    return _tag(number, 2) + _varint(len(payload)) + payload


def _repeated(number: int, wire: int, encoded: list[bytes], how: str, rng: np.random.Generator) -> bytes:
    """A repeated field's values (each encoded) written ``packed`` (one run), ``unpacked`` (a field each) or
    ``mixed`` (packed runs and single values in turn), as readers must take them all."""
    if how == "packed":
        return _field(number, b"".join(encoded)) if encoded else b""
    if how == "unpacked":
        return b"".join(_tag(number, wire) + value for value in encoded)
    out = b""
    position = 0
    while position < len(encoded):
        step = int(rng.integers(1, 6))
        if rng.random() < 0.5:
            out += _field(number, b"".join(encoded[position : position + step]))
        else:
            out += b"".join(_tag(number, wire) + value for value in encoded[position : position + step])
        position += step
    return out


def _values(data_type: int, count: int, rng: np.random.Generator, small: bool) -> tuple[str, list[bytes]]:
    """Random values of the typed field of ``data_type``, each encoded: float_data and double_data from normal
    numbers with infinities, zeros of both signs, a quiet NaN and subnormals; the varint fields over their whole
    range, with bits past an int32 set (protobuf drops them) where the field is int32_data, or (``small``) all
    under 128."""
    name = FIELD_OF.get(data_type, "int32_data")
    if data_type in (TensorProto.COMPLEX64, TensorProto.COMPLEX128):
        count *= 2
    if data_type == TensorProto.FLOAT4E2M1:
        count = (count + 1) // 2
    if name in ("float_data", "double_data"):
        kind = np.float32 if name == "float_data" else np.float64
        values = rng.standard_normal(count).astype(kind) * 1e3
        specials = np.array([np.inf, -np.inf, -0.0, np.nan, np.finfo(kind).smallest_subnormal], kind)
        values[: min(count, 5)] = specials[: min(count, 5)]
        rng.shuffle(values)
        return name, [value.tobytes() for value in values]
    if small:
        numbers = [int(n) for n in rng.integers(0, 128, count)]
    elif name == "int32_data":
        numbers = [int(n) & (2**64 - 1) for n in rng.integers(-(2**31), 2**31, count)]  # negatives: 10 bytes
        numbers = [n | (int(rng.integers(1, 2**20)) << 40) if rng.random() < 0.2 else n for n in numbers]
    else:
        numbers = [int(n) for n in rng.integers(0, 2**64, count, dtype=np.uint64)]
    return name, [_varint(n) for n in numbers]


def _tensor(data_type: int, dims: list[int], storage: str, rng: np.random.Generator, small: bool = False) -> bytes:
    """A TensorProto written field by field: dims packed or not, and its values in ``raw_data`` (random bytes) or
    its typed field, written ``packed``, ``unpacked`` or ``mixed``."""
    dims_how = "packed" if rng.random() < 0.5 else "unpacked"
    out = _repeated(1, 0, [_varint(dim) for dim in dims], dims_how, rng) + _tag(2, 0) + _varint(data_type)
    out += _field(8, b"t")
    count = int(np.prod(dims))
    if storage == "raw":
        bits = onnx_format.DTYPE_BITS[onnx_format.DTYPES[data_type]]
        return out + _field(9, rng.bytes(count * bits // 8))
    name, encoded = _values(data_type, count, rng, small)
    number, wire = FIELDS[name]
    return out + _repeated(number, wire, encoded, storage, rng)


def _model(tensor: bytes) -> bytes:
    """A ModelProto of ``ir_version`` and a graph holding ``tensor`` as its one initializer."""
    return b"\x08\x0a" + _field(7, _field(5, tensor))


def _stfs_bytes(data: bytes) -> tuple[bytes | None, list[str]]:
    """The one tensor's bytes as stfs serves them (``None`` if left out), and the warnings."""
    header = onnx_format.fetch_header(lambda o, s: data[o : o + s], path="m.onnx", file_size=len(data))
    if not header.tensors:
        return None, list(header.warnings)
    (entry,) = header.tensors
    return (entry.held.data if entry.held is not None else data[entry.begin : entry.end]), list(header.warnings)


def _to_array_bytes(data: bytes) -> bytes:
    """``to_array``'s bytes of the one tensor as the onnx package parses the model; 4- and 6-bit types packed as
    raw_data (and safetensors) packs them."""
    (tensor,) = onnx.ModelProto.FromString(data).graph.initializer
    array = numpy_helper.to_array(tensor)
    if tensor.data_type in (TensorProto.FLOAT4E2M1, TensorProto.FLOAT6E2M3, TensorProto.FLOAT6E3M2):
        return numpy_helper.from_array(array).raw_data
    return array.tobytes()


def _shapes(data_type: int, rng: np.random.Generator) -> list[list[int]]:
    """A scalar, an empty tensor and random shapes of one to four dims, each a whole number of bytes."""
    shapes = [[], [0], [0, 3], [4], [2, 4]]
    shapes += [[int(d) for d in rng.integers(1, 7, int(rng.integers(1, 5)))] for _ in range(4)]
    bits = onnx_format.DTYPE_BITS[onnx_format.DTYPES[data_type]]
    return [shape for shape in shapes if int(np.prod(shape)) * bits % 8 == 0]


@pytest.mark.parametrize("data_type", SERVED, ids=[TensorProto.DataType.Name(t) for t in SERVED])
def test_every_data_type_and_storage_is_to_arrays_bytes(data_type: int) -> None:
    """For every data_type stfs serves, in raw_data and in its typed field (packed, unpacked, both mixed; dims
    packed or not), random shapes and values: the bytes stfs serves are ``to_array``'s, the model parsed by the
    onnx package."""
    rng = np.random.default_rng(data_type)
    cases = 0
    for shape in _shapes(data_type, rng):
        for storage in ("raw", "packed", "unpacked", "mixed"):
            for small in (False, True):
                data = _model(_tensor(data_type, shape, storage, rng, small))
                served, warnings = _stfs_bytes(data)
                assert served == _to_array_bytes(data), (shape, storage, small)
                assert not warnings
                cases += 1
    assert cases >= 40


@pytest.mark.parametrize(
    ("data_type", "count"),
    [
        (TensorProto.FLOAT16, 30_000),  # past PYTHON_VARINTS: numpy decodes the varints
        (TensorProto.INT32, 300_000),  # negatives of 10 bytes: more than one NUMPY_CHUNK
        (TensorProto.INT64, 150_000),
        (TensorProto.UINT32, 20_000),
        (TensorProto.FLOAT6E3M2, 40_000),
        (TensorProto.FLOAT4E2M1, 40_000),
        (TensorProto.BFLOAT16, 50_000),
        (TensorProto.FLOAT, 10_000),
    ],
    ids=lambda value: str(value) if isinstance(value, int) and value > 100 else TensorProto.DataType.Name(value),
)
def test_long_typed_fields_are_to_arrays_bytes(data_type: int, count: int) -> None:
    rng = np.random.default_rng(count)
    for storage in ("packed", "mixed"):
        data = _model(_tensor(data_type, [count], storage, rng))
        assert _stfs_bytes(data)[0] == _to_array_bytes(data), storage


@pytest.mark.parametrize(
    "data_type", sorted(NOT_SERVED), ids=[TensorProto.DataType.Name(t) for t in sorted(NOT_SERVED)]
)
def test_the_types_safetensors_lacks_are_left_out_in_every_storage(data_type: int) -> None:
    rng = np.random.default_rng(data_type)
    for storage in ("packed", "unpacked"):
        tensor = _tag(1, 0) + _varint(4) + _tag(2, 0) + _varint(data_type) + _field(8, b"t")
        if data_type == TensorProto.STRING:
            tensor += b"".join(_field(6, word) for word in (b"a", b"bc", b"", b"d"))
        else:
            name, encoded = _values(data_type, 4, rng, small=True)
            tensor += _repeated(FIELDS[name][0], FIELDS[name][1], encoded, storage, rng)
        served, warnings = _stfs_bytes(_model(tensor))
        assert served is None
        assert warnings == [
            f"m.onnx: tensor 't' is left out: its data_type {TensorProto.DataType.Name(data_type)} has no "
            "safetensors dtype"
        ]


def test_a_packed_run_that_ends_inside_a_value_is_refused() -> None:
    """As the onnx package refuses it: a packed varint run whose last varint runs on, a float_data run that is not
    whole floats."""
    head = _tag(1, 0) + _varint(2) + _field(8, b"t")
    for tensor in (
        head + _tag(2, 0) + _varint(TensorProto.FLOAT16) + _field(5, b"\x01\x83"),
        head + _tag(2, 0) + _varint(TensorProto.FLOAT) + _field(4, bytes(8)) + _field(4, bytes(6)),
        _field(1, b"\x02\x83") + _tag(2, 0) + _varint(TensorProto.FLOAT) + _field(9, bytes(8)),
    ):
        data = _model(tensor)
        with pytest.raises(Exception, match="corrupt"):
            onnx.ModelProto.FromString(data)
        with pytest.raises((onnx_format.InvalidProtobuf, onnx_format.TruncatedProtobuf)):
            onnx_format.fetch_header(lambda o, s, data=data: data[o : o + s], path="m.onnx", file_size=len(data))


def test_a_remote_model_with_external_data_mounts(nginx: Any, tmp_path: Path, mount: MountFn) -> None:
    model = rich_model()
    local = tmp_path / "model.onnx"
    onnx.save_model(model, str(local), save_as_external_data=True, location="model.onnx.data", size_threshold=64)
    url = nginx.put("model.onnx", local.read_bytes())
    nginx.put("model.onnx.data", (tmp_path / "model.onnx.data").read_bytes())
    mnt = mount(url, options=["view=f32"])
    check_mount(mnt, expected(onnx.load(str(local))), model)
    weight = Path(mnt, "tensors", "model", "embed", "weight")
    assert os.getxattr(weight, "user.onnx.file").decode() == url + ".data"
    assert sorted(os.listdir(Path(mnt, "files"))) == ["model.onnx", "model.onnx.data"]
