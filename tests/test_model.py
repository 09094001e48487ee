"""Models: SOURCE resolution, sharded-set rules (docs/validation.md), absolute offsets, the merged header."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from stfs import errors
from stfs.errors import InvalidModel
from stfs.model import Model, ModelSource, discover, load, read_header, resolve
from stfs.views import merged_header
from tests.models import rich_arrays, sharded_arrays, tensor_bytes, write_header, write_numpy, write_sharded

SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


def small(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.integers(0, 9, 5).astype(np.int64)}


def data_start(path: str) -> int:
    with open(path, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
    return 8 + length


def read_at(path: str, offset: int, size: int) -> bytes:
    with open(path, "rb") as stream:
        stream.seek(offset)
        return stream.read(size)


def problems_of(source: str) -> list[errors.StfsError]:
    with pytest.raises(InvalidModel) as caught:
        resolve(source)
    assert caught.value.problems
    return caught.value.problems


# -- SOURCE resolution -------------------------------------------------------------------------------------------------


def test_single_file(tmp_path: Path) -> None:
    arrays = rich_arrays()
    path = write_numpy(str(tmp_path / "x.safetensors"), arrays, metadata={"format": "np"})
    assert discover(path) == [ModelSource(name="", path=path)]
    [model] = resolve(path)
    assert model.name == ""
    assert model.path == path
    assert not model.is_sharded
    assert model.index_path is None
    assert model.metadata == {"format": "np"}
    assert [shard.name for shard in model.shards] == ["x.safetensors"]
    assert {t.name for t in model.tensors} == set(arrays)
    assert model.data_size == sum(a.nbytes for a in arrays.values())
    assert model.warnings == ()


def test_read_header_of_a_path_keeps_no_descriptor(tmp_path: Path) -> None:
    # read_header(path) opens a source of its own: a long-lived caller (a fuzzer, a server) must not run out of them
    path = write_numpy(tmp_path / "m.safetensors", small())
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        assert [entry.name for entry in read_header(str(path)).tensors] == ["b", "w"]
    assert len(os.listdir("/proc/self/fd")) == before


def test_relative_source_becomes_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_numpy(str(tmp_path / "x.safetensors"), small())
    monkeypatch.chdir(tmp_path)
    [model] = resolve("x.safetensors")
    assert model.path == str(tmp_path / "x.safetensors")
    assert all(os.path.isabs(t.file) for t in model.tensors)


def test_absolute_offsets_of_a_single_file(tmp_path: Path) -> None:
    arrays = rich_arrays()
    path = write_numpy(str(tmp_path / "x.safetensors"), arrays)
    [model] = resolve(path)
    header = json.loads(read_at(path, 8, data_start(path) - 8))
    for tensor in model.tensors:
        assert tensor.file == path
        assert tensor.shard is None
        assert tensor.offset == data_start(path) + header[tensor.name]["data_offsets"][0]
        assert read_at(path, tensor.offset, tensor.size) == tensor_bytes(path, tensor.name)
        assert tensor_bytes(path, tensor.name) == arrays[tensor.name].tobytes()
        assert tensor.size == arrays[tensor.name].nbytes
        assert tensor.parameters == arrays[tensor.name].size
        assert tensor.shape == arrays[tensor.name].shape


def test_offset_is_8_plus_n_plus_begin(tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b": {"dtype": "U8", "shape": [2], "data_offsets": [3, 5]},
    }
    raw = json.dumps(header).encode() + b"   "
    path = write_header(str(tmp_path / "h.safetensors"), None, raw=raw, data=b"abcde")
    [model] = resolve(path)
    offsets = {t.name: (t.offset, t.size) for t in model.tensors}
    assert offsets == {"a": (8 + len(raw), 3), "b": (8 + len(raw) + 3, 2)}


def test_index_path(tmp_path: Path) -> None:
    index = write_sharded(str(tmp_path / "m"), sharded_arrays())
    assert discover(index) == [ModelSource(name="", path=index)]
    assert discover(index)[0].is_index
    [model] = resolve(index)
    assert model.is_sharded
    assert model.index_path == index
    assert model.path == index
    assert [shard.name for shard in model.shards] == [SHARD1, SHARD2]
    assert model.warnings == ()


def test_absolute_offsets_of_a_sharded_set(tmp_path: Path) -> None:
    shards = sharded_arrays()
    folder = tmp_path / "m"
    [model] = resolve(write_sharded(str(folder), shards))
    names = {name: shard for shard, arrays in shards.items() for name in arrays}
    assert {t.name for t in model.tensors} == set(names)
    for tensor in model.tensors:
        shard_path = str(folder / names[tensor.name])
        assert tensor.shard == names[tensor.name]
        assert tensor.file == shard_path
        with open(shard_path, "rb") as stream:
            (length,) = struct.unpack("<Q", stream.read(8))
            begin, end = json.loads(stream.read(length))[tensor.name]["data_offsets"]
        assert tensor.offset == 8 + length + begin
        assert tensor.size == end - begin
        assert read_at(shard_path, tensor.offset, tensor.size) == tensor_bytes(shard_path, tensor.name)
        assert tensor_bytes(shard_path, tensor.name) == shards[names[tensor.name]][tensor.name].tobytes()


def test_directory_with_one_file(tmp_path: Path) -> None:
    (tmp_path / "deep").mkdir()
    path = write_numpy(str(tmp_path / "deep" / "x.safetensors"), small())
    (tmp_path / "config.json").write_text("{}")
    assert discover(str(tmp_path)) == [ModelSource(name="", path=path)]
    [model] = resolve(str(tmp_path))
    assert model.name == ""
    assert model.path == path


def test_directory_with_one_sharded_set(tmp_path: Path) -> None:
    index = write_sharded(str(tmp_path), sharded_arrays())
    (tmp_path / "config.json").write_text("{}")
    assert discover(str(tmp_path)) == [ModelSource(name="", path=index)]
    [model] = resolve(str(tmp_path))
    assert model.is_sharded
    assert len(model.tensors) == 4


def test_directory_of_several_models(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for folder in ("unet", "vae", "text_encoder", "text_encoder/sub"):
        (repo / folder).mkdir(parents=True)
    write_numpy(str(repo / "unet" / "diffusion_pytorch_model.safetensors"), small(1))
    write_numpy(str(repo / "vae" / "diffusion_pytorch_model.safetensors"), small(2))
    write_numpy(str(repo / "text_encoder" / "sub" / "model.safetensors"), small(3))
    write_numpy(str(repo / "model.safetensors"), small(4))
    write_sharded(
        str(repo / "transformer"), sharded_arrays(), index_name="diffusion_pytorch_model.safetensors.index.json"
    )
    (repo / "unet" / "config.json").write_text("{}")
    (repo / "README.md").write_text("hi")
    (repo / "model.bin").write_bytes(b"\0" * 16)

    found = discover(str(repo))
    assert {m.name: os.path.relpath(m.path, repo) for m in found} == {
        "model": "model.safetensors",
        "text_encoder/sub/model": "text_encoder/sub/model.safetensors",
        "transformer/diffusion_pytorch_model": "transformer/diffusion_pytorch_model.safetensors.index.json",
        "unet/diffusion_pytorch_model": "unet/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model": "vae/diffusion_pytorch_model.safetensors",
    }
    models = {m.name: m for m in resolve(str(repo))}
    assert models["transformer/diffusion_pytorch_model"].is_sharded
    assert len(models["transformer/diffusion_pytorch_model"].tensors) == 4
    assert not models["unet/diffusion_pytorch_model"].is_sharded
    assert tensor_bytes(models["vae/diffusion_pytorch_model"].path, "w") == small(2)["w"].tobytes()


def test_shards_are_not_models_but_a_stray_file_next_to_them_is(tmp_path: Path) -> None:
    write_sharded(str(tmp_path), sharded_arrays())
    write_numpy(str(tmp_path / "extra.safetensors"), small())
    found = discover(str(tmp_path))
    assert sorted(m.name for m in found) == ["extra", "model"]
    assert sorted(os.path.basename(m.path) for m in found) == ["extra.safetensors", "model.safetensors.index.json"]


def test_shard_in_a_subfolder_of_its_index(tmp_path: Path) -> None:
    (tmp_path / "parts").mkdir()
    write_numpy(str(tmp_path / "parts" / "a.safetensors"), {"x": np.ones(2, np.float32)})
    write_numpy(str(tmp_path / "parts" / "b.safetensors"), {"y": np.ones(3, np.float32)})
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"x": "parts/a.safetensors", "y": "parts/b.safetensors"}}))
    assert discover(str(tmp_path)) == [ModelSource(name="", path=str(index))]
    [model] = resolve(str(tmp_path))
    assert [shard.name for shard in model.shards] == ["parts/a.safetensors", "parts/b.safetensors"]
    assert json.loads(merged_header(model))["y"]["file"] == "parts/b.safetensors"


@pytest.mark.parametrize("junk", [[], ["config.json", "README.md", "pytorch_model.bin"]])
def test_directory_without_models(tmp_path: Path, junk: list[str]) -> None:
    for name in junk:
        (tmp_path / name).write_text("x")
    with pytest.raises(errors.SourceError, match=str(tmp_path)):
        discover(str(tmp_path))
    with pytest.raises(errors.SourceError):
        resolve(str(tmp_path))


def test_missing_source(tmp_path: Path) -> None:
    with pytest.raises(errors.SourceError, match="nope"):
        resolve(str(tmp_path / "nope.safetensors"))


def test_two_models_with_the_same_name(tmp_path: Path) -> None:
    write_numpy(str(tmp_path / "a.safetensors"), small())
    write_numpy(str(tmp_path / "s.safetensors"), {"z": np.ones(1, np.float32)})
    (tmp_path / "a.safetensors.index.json").write_text(json.dumps({"weight_map": {"z": "s.safetensors"}}))
    with pytest.raises(errors.SourceError, match="'a'"):
        discover(str(tmp_path))


def test_a_broken_single_file_is_a_format_error(tmp_path: Path) -> None:
    path = write_header(str(tmp_path / "x.safetensors"), {"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}})
    with pytest.raises(errors.MetadataIncompleteBuffer, match=str(path)):
        resolve(path)


# -- sharded sets ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["{", "", "not json", '{"weight_map": {"a": "x.safetensors",}}', "[1, 2]", "null", '{"weight_map": {"a": NaN}}'],
)
def test_invalid_index_json(tmp_path: Path, text: str) -> None:
    write_sharded(str(tmp_path), sharded_arrays())
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(text)
    with pytest.raises(errors.InvalidIndex, match=str(index)):
        resolve(str(index))
    with pytest.raises(errors.InvalidIndex, match=str(index)):
        resolve(str(tmp_path))


def test_deeply_nested_index(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {}, "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(errors.InvalidIndex, match=str(index)):
        resolve(str(index))


@pytest.mark.parametrize(
    "document",
    [
        {},
        {"metadata": {"total_size": 1}},
        {"weight_map": []},
        {"weight_map": "model.safetensors"},
        {"weight_map": {"a": 1}},
        {"weight_map": {"a": None}},
        {"weight_map": {"a": ["x.safetensors"]}},
    ],
)
def test_index_without_a_weight_map(tmp_path: Path, document: object) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps(document))
    with pytest.raises(errors.InvalidIndex, match="weight_map"):
        resolve(str(index))


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "a/../../b.safetensors", ""])
def test_shard_outside_the_index_folder(tmp_path: Path, shard: str) -> None:
    index = tmp_path / "m" / "model.safetensors.index.json"
    index.parent.mkdir()
    index.write_text(json.dumps({"weight_map": {"a": shard}}))
    with pytest.raises(errors.InvalidIndex, match=str(index)):
        resolve(str(index))


def test_missing_shard(tmp_path: Path) -> None:
    index = write_sharded(str(tmp_path), sharded_arrays())
    os.unlink(tmp_path / SHARD2)
    [problem] = problems_of(index)
    assert isinstance(problem, errors.MissingShard)
    assert index in problem.message and SHARD2 in problem.message


def test_every_missing_shard_is_a_problem(tmp_path: Path) -> None:
    index = write_sharded(str(tmp_path), sharded_arrays())
    os.unlink(tmp_path / SHARD1)
    os.unlink(tmp_path / SHARD2)
    problems = problems_of(index)
    assert [type(p) for p in problems] == [errors.MissingShard, errors.MissingShard]
    assert [SHARD1 in problems[0].message, SHARD2 in problems[1].message] == [True, True]


def test_broken_shard_is_a_problem_naming_the_shard(tmp_path: Path) -> None:
    index = write_sharded(str(tmp_path), sharded_arrays())
    with open(tmp_path / SHARD1, "ab") as stream:
        stream.write(b"junk")
    [problem] = problems_of(index)
    assert isinstance(problem, errors.MetadataIncompleteBuffer)
    assert problem.message.startswith(str(tmp_path / SHARD1))


def test_tensor_named_by_the_index_missing_from_its_shard(tmp_path: Path) -> None:
    shards = sharded_arrays()
    weight_map = {name: shard for shard, arrays in shards.items() for name in arrays}
    weight_map["model.layers.9.ghost.weight"] = SHARD2
    index = write_sharded(str(tmp_path), shards, weight_map=weight_map)
    [problem] = problems_of(index)
    assert isinstance(problem, errors.TensorNotInShard)
    assert "'model.layers.9.ghost.weight'" in problem.message and SHARD2 in problem.message
    assert index in problem.message


def test_tensor_mapped_to_the_wrong_shard(tmp_path: Path) -> None:
    shards = sharded_arrays()
    weight_map = {name: shard for shard, arrays in shards.items() for name in arrays}
    weight_map["lm_head.weight"] = SHARD1
    index = write_sharded(str(tmp_path), shards, weight_map=weight_map)
    [problem] = problems_of(index)
    assert isinstance(problem, errors.TensorNotInShard)
    assert "'lm_head.weight'" in problem.message
    assert f"it is in {SHARD2!r}" in problem.message


def test_one_tensor_in_two_shards(tmp_path: Path) -> None:
    shards = sharded_arrays()
    shards[SHARD2]["model.embed_tokens.weight"] = np.zeros((2, 2), np.float32)
    weight_map = {name: shard for shard, arrays in sharded_arrays().items() for name in arrays}
    index = write_sharded(str(tmp_path), shards, weight_map=weight_map)
    problems = problems_of(index)
    assert [type(p) for p in problems] == [errors.DuplicateTensor]
    assert "'model.embed_tokens.weight'" in problems[0].message
    assert SHARD1 in problems[0].message and SHARD2 in problems[0].message


def test_tensor_a_shard_has_but_the_index_does_not_name(tmp_path: Path) -> None:
    shards = sharded_arrays()
    weight_map = {name: shard for shard, arrays in shards.items() for name in arrays}
    del weight_map["lm_head.weight"]
    index = write_sharded(str(tmp_path), shards, weight_map=weight_map)
    [model] = resolve(index)
    assert "lm_head.weight" in {t.name for t in model.tensors}
    assert len(model.warnings) == 1
    assert "'lm_head.weight'" in model.warnings[0] and SHARD2 in model.warnings[0]
    lm_head = next(t for t in model.tensors if t.name == "lm_head.weight")
    assert lm_head.shard == SHARD2
    assert read_at(lm_head.file, lm_head.offset, lm_head.size) == shards[SHARD2]["lm_head.weight"].tobytes()


@pytest.mark.parametrize("declared", [1, 0, 10**20, "3872", None])
def test_total_size_mismatch_is_a_warning(tmp_path: Path, declared: object) -> None:
    shards = sharded_arrays()
    total = sum(a.nbytes for arrays in shards.values() for a in arrays.values())
    index = write_sharded(str(tmp_path), shards)
    document = json.loads(Path(index).read_text())
    document["metadata"]["total_size"] = declared
    Path(index).write_text(json.dumps(document))
    [model] = resolve(index)
    assert model.data_size == total
    if declared is None:
        assert model.warnings == ()
    else:
        [warning] = model.warnings
        assert "total_size" in warning and str(total) in warning and index in warning


def test_total_size_that_agrees_and_no_metadata_at_all(tmp_path: Path) -> None:
    index = write_sharded(str(tmp_path), sharded_arrays())
    assert resolve(index)[0].warnings == ()
    Path(index).write_text(json.dumps({"weight_map": json.loads(Path(index).read_text())["weight_map"]}))
    assert resolve(index)[0].warnings == ()


# -- merged header -----------------------------------------------------------------------------------------------------


def shard_header(path: Path) -> dict:
    with open(path, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        return json.loads(stream.read(length))


def test_merged_header(tmp_path: Path) -> None:
    shards = sharded_arrays()
    index = write_sharded(
        str(tmp_path), shards, metadata={SHARD1: {"format": "pt", "one": "1"}, SHARD2: {"format": "np", "two": "2"}}
    )
    [model] = resolve(index)
    merged = json.loads(merged_header(model))
    assert merged.pop("__metadata__") == {"format": "pt", "one": "1", "two": "2"}
    weight_map = json.loads(Path(index).read_text())["weight_map"]
    assert set(merged) == set(weight_map)
    for name, entry in merged.items():
        assert entry["file"] == weight_map[name]
        original = shard_header(tmp_path / weight_map[name])[name]
        assert {k: entry[k] for k in ("dtype", "shape", "data_offsets")} == original
    assert model.metadata == {"format": "pt", "one": "1", "two": "2"}


def test_first_shard_wins_even_when_the_weight_map_lists_it_last(tmp_path: Path) -> None:
    # Hugging Face indexes sort weight_map by tensor name: lm_head.weight (shard 2) comes first.
    shards = sharded_arrays()
    weight_map = dict(sorted((name, shard) for shard, arrays in shards.items() for name in arrays))
    assert next(iter(weight_map.values())) == SHARD2
    index = write_sharded(
        str(tmp_path), shards, weight_map=weight_map, metadata={SHARD1: {"format": "pt"}, SHARD2: {"format": "np"}}
    )
    [model] = resolve(index)
    assert json.loads(merged_header(model))["__metadata__"] == {"format": "pt"}
    assert [shard.name for shard in model.shards] == [SHARD1, SHARD2]


def test_shards_in_natural_order(tmp_path: Path) -> None:
    shards = {f"part-{i}.safetensors": {f"t{i}": np.full(2, i, np.int32)} for i in (10, 2, 1)}
    metadata = {name: {"who": name} for name in shards}
    index = write_sharded(str(tmp_path), shards, metadata=metadata)
    [model] = resolve(index)
    assert [shard.name for shard in model.shards] == ["part-1.safetensors", "part-2.safetensors", "part-10.safetensors"]
    assert model.metadata == {"who": "part-1.safetensors"}


def test_merged_header_without_metadata_and_with_odd_names(tmp_path: Path) -> None:
    names = ["a.b", "a.b.c", "é/🦀", "", "x\x00y"]
    shards = {
        "s1.safetensors": {names[0]: np.ones(1, np.uint8), names[1]: np.ones(2, np.uint8)},
        "s2.safetensors": {n: np.ones(3, np.uint8) for n in names[2:]},
    }
    [model] = resolve(write_sharded(str(tmp_path), shards))
    merged = json.loads(merged_header(model).decode("utf-8"))
    assert "__metadata__" not in merged
    assert set(merged) == set(names)
    assert merged["é/🦀"]["file"] == "s2.safetensors"


def test_model_with_no_tensors(tmp_path: Path) -> None:
    path = write_header(str(tmp_path / "empty.safetensors"), {})
    [model] = resolve(path)
    assert model.tensors == ()
    assert model.data_size == 0
    assert isinstance(model, Model)


def test_load_of_a_model_source(tmp_path: Path) -> None:
    path = write_numpy(str(tmp_path / "x.safetensors"), small())
    model = load(ModelSource(name="folder/x", path=path))
    assert model.name == "folder/x"
    assert {t.name for t in model.tensors} == {"w", "b"}


def test_shard_name_with_a_lone_surrogate(tmp_path: Path) -> None:
    # "\udcff" would name the non-UTF-8 file b"\xff.safetensors", whose name no header.json could hold.
    folder = os.fsencode(tmp_path)
    write_numpy(os.fsdecode(os.path.join(folder, b"\xff.safetensors")), {"w": np.ones(2, np.float32)})
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": os.fsdecode(b"\xff.safetensors")}}))
    with pytest.raises(errors.InvalidIndex, match="surrogate"):
        resolve(str(index))


def test_one_shard_spelled_two_ways_is_read_once(tmp_path) -> None:  # noqa: ANN001
    shards = sharded_arrays()
    first, second = list(shards)
    weight_map = {name: shard for shard, arrays in shards.items() for name in arrays}
    weight_map[next(iter(shards[first]))] = "./" + first  # the same file, another spelling
    index = write_sharded(str(tmp_path / "repo"), shards, weight_map=weight_map)
    model = load(ModelSource(name="", path=index))
    assert sorted(shard.name for shard in model.shards) == sorted([first, second])
    assert len(model.tensors) == sum(len(arrays) for arrays in shards.values())


def test_loading_local_files_leaves_no_descriptor_open(tmp_path: Path) -> None:
    """``discover``, ``load`` and ``resolve`` given no source read local files and close what they opened: a program
    (or a test run) that loads many models does not run out of descriptors."""
    folder = tmp_path / "set"
    folder.mkdir()
    write_sharded(str(folder), sharded_arrays())
    write_numpy(str(tmp_path / "one.safetensors"), rich_arrays())

    def descriptors() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    before = descriptors()
    for _ in range(3):
        [sharded] = [load(found) for found in discover(str(folder))]
        assert len(sharded.shards) == 2
        assert [model.name for model in resolve(str(tmp_path))]
    assert descriptors() <= before
