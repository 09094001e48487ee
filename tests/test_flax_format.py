"""Flax msgpack checkpoints (SPEC §17): files flax.serialization.to_bytes writes in the test run, mounted and read
through the mount, compared with what flax.serialization.msgpack_restore gives; chunked arrays gathered; a sharded
set as transformers writes it; --view safetensors's names; the framing read by Range; refusals in one line."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stfs import errors
from stfs.model import read_header
from tests.helpers import MountFn, run, short_fuzz_run, stfs_command
from tests.servers import Nginx

serialization = pytest.importorskip("flax.serialization")
jnp = pytest.importorskip("jax.numpy")
msgpack = pytest.importorskip("msgpack")

MIB = 1 << 20


def state() -> dict[str, Any]:
    """A state dict as a Flax model's: nested params of several dtypes, a numpy scalar, plain values."""
    rng = np.random.default_rng(0)
    return {
        "params": {
            "embed": {"embedding": rng.standard_normal((16, 8)).astype(np.float32)},
            "layers_0": {
                "kernel": jnp.asarray(rng.standard_normal((8, 8)), dtype=jnp.bfloat16),
                "bias": rng.standard_normal(8).astype(np.float16),
            },
            "norm": {"scale": np.ones(8, np.float64), "mask": np.array([True, False, True])},
            "ids": np.arange(-3, 3, dtype=np.int8).reshape(2, 3),
            "counts": np.arange(5, dtype=np.uint32),
            "empty": np.zeros((0, 4), np.float32),
        },
        "step": np.int32(1200),
        "config": {"name": "tiny", "layers": 1, "dropout": 0.1, "tied": True, "nothing": None},
    }


def flat(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(name, leaf)`` of a restored state dict, named by its path of keys joined by ``.``."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def restored(path: Path) -> dict[str, Any]:
    """The arrays flax's reader gives for the file: name -> numpy array (a numpy scalar as a 0-dim array)."""
    tree = serialization.msgpack_restore(path.read_bytes())
    return {name: np.asarray(leaf) for name, leaf in flat(tree) if isinstance(leaf, np.ndarray | np.generic)}


def write(path: Path, tree: dict[str, Any], chunk: int | None = None, monkeypatch: Any = None) -> Path:
    if chunk is not None:
        monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", chunk)  # flax chunks arrays over this many bytes
    path.write_bytes(serialization.to_bytes(tree))
    return path


def tensor_file(mnt: str, name: str) -> Path:
    return Path(mnt, "tensors", *name.split("."))


def test_every_array_is_a_tensor_file_of_the_bytes_msgpack_restore_gives(tmp_path: Path, mount: MountFn) -> None:
    source = write(tmp_path / "flax_model.msgpack", state())
    expected = restored(source)
    mnt = mount(str(source))
    header = json.loads(Path(mnt, "header.json").read_bytes())
    assert set(header) - {"__metadata__"} == set(expected)
    dtypes = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "bool": "BOOL", "int8": "I8"}
    dtypes |= {"uint32": "U32", "int32": "I32"}
    for name, array in expected.items():
        path = tensor_file(mnt, name)
        assert path.read_bytes() == array.tobytes(), name
        assert header[name]["shape"] == list(array.shape) and header[name]["dtype"] == dtypes[array.dtype.name]
        assert os.getxattr(path, "user.flax.name").decode() == name
        offset = int(os.getxattr(path, "user.flax.offset"))
        assert source.read_bytes()[offset : offset + array.nbytes] == array.tobytes()  # a range of the file
    metadata = {name: Path(mnt, "metadata", name).read_text() for name in os.listdir(Path(mnt, "metadata"))}
    assert metadata == {
        "format": "flax\n",
        "config.name": "tiny\n",
        "config.layers": "1\n",
        "config.dropout": "0.1\n",
        "config.tied": "true\n",
        "config.nothing": "null\n",
    }
    assert Path(mnt, "files", source.name).read_bytes() == source.read_bytes()


def test_a_chunked_array_is_gathered_from_its_chunks(tmp_path: Path, mount: MountFn, monkeypatch: Any) -> None:
    rng = np.random.default_rng(1)
    tree = {"big": {"kernel": rng.standard_normal((37, 11)).astype(np.float32)}, "small": np.arange(3, dtype=np.int64)}
    source = write(tmp_path / "chunked.msgpack", tree, chunk=64, monkeypatch=monkeypatch)
    assert b"__msgpack_chunked_array__" in source.read_bytes()
    expected = restored(source)
    assert set(expected) == {"big.kernel", "small"}  # flax's own reader puts the chunks back together
    header = read_header(str(source))
    [big] = [entry for entry in header.tensors if entry.name == "big.kernel"]
    assert big.scattered is not None and big.size == expected["big.kernel"].nbytes
    mnt = mount(str(source), options=["view=f32"])
    data = tensor_file(mnt, "big.kernel").read_bytes()
    assert data == expected["big.kernel"].tobytes()
    with open(tensor_file(mnt, "big.kernel"), "rb") as stream:  # reads at any offset and size, across chunks
        for offset, size in [(0, 1), (60, 17), (63, 2), (1000, 600), (len(data) - 3, 10)]:
            stream.seek(offset)
            assert stream.read(size) == data[offset : offset + size]
    assert np.array_equal(np.memmap(tensor_file(mnt, "big.kernel"), np.float32, "r"), expected["big.kernel"].ravel())
    assert Path(mnt, "f32", "big", "kernel").read_bytes() == data
    assert tensor_file(mnt, "small").read_bytes() == expected["small"].tobytes()


def safetensors_bytes(path: Path) -> dict[str, bytes]:
    """Each tensor's bytes in a safetensors file, as its header places them (any dtype, BF16 too)."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    start = 8 + length
    return {name: data[start + e["data_offsets"][0] : start + e["data_offsets"][1]] for name, e in header.items()}


def shards(folder: Path, params: dict[str, Any], size: int) -> dict[str, str]:
    """A sharded set as transformers' FlaxPreTrainedModel.save_pretrained writes it (``flax_shard_checkpoint``): the
    params flattened with ``/`` between keys, cut into shards of about ``size`` bytes in key order, each shard the
    flat dict written by flax.serialization.to_bytes, and ``flax_model.msgpack.index.json``. Its weight_map."""
    from flax.traverse_util import flatten_dict

    weights = flatten_dict(params, sep="/")
    blocks: list[dict[str, Any]] = [{}]
    for key, value in weights.items():
        if blocks[-1] and sum(np.asarray(v).nbytes for v in blocks[-1].values()) + np.asarray(value).nbytes > size:
            blocks.append({})
        blocks[-1][key] = value
    weight_map = {}
    for number, block in enumerate(blocks, 1):
        name = f"flax_model-{number:05d}-of-{len(blocks):05d}.msgpack"
        (folder / name).write_bytes(serialization.to_bytes(block))
        weight_map.update(dict.fromkeys(block, name))
    total = sum(np.asarray(value).nbytes for value in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "flax_model.msgpack.index.json").write_text(json.dumps(index, indent=2))
    return weight_map


def test_a_sharded_set_mounts_by_its_index_with_dotted_names(tmp_path: Path, mount: MountFn) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    params = state()["params"]
    weight_map = shards(repo, params, 100)
    assert len(set(weight_map.values())) >= 3
    mnt = mount(str(repo), options=["view=safetensors"])
    expected = {name: np.asarray(value) for name, value in flat(params)}
    for name, array in expected.items():
        assert tensor_file(mnt, name).read_bytes() == array.tobytes(), name
    header = json.loads(Path(mnt, "header.json").read_bytes())
    assert {name: header[name]["file"] for name in expected} == {k.replace("/", "."): v for k, v in weight_map.items()}
    index = json.loads(Path(mnt, "safetensors", "model.safetensors.index.json").read_bytes())
    assert set(index["weight_map"]) == set(expected)
    for name, file in index["weight_map"].items():
        assert file.startswith("model-") and file.endswith(".safetensors")
        assert safetensors_bytes(Path(mnt, "safetensors", file))[name] == expected[name].tobytes(), name


@pytest.mark.parametrize("beside", [False, True], ids=["alone", "beside-model.safetensors"])
def test_view_safetensors_names_flax_model_after_what_the_folder_holds(
    tmp_path: Path, mount: MountFn, beside: bool
) -> None:
    from safetensors import safe_open
    from safetensors.numpy import save_file

    repo = tmp_path / "repo"
    repo.mkdir()
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float16)}
    write(repo / "flax_model.msgpack", tree)
    if beside:
        save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(repo / "model.safetensors"))
    mnt = mount(str(repo), options=["view=safetensors"])
    names = sorted(os.listdir(Path(mnt, "safetensors")))
    assert names == (["flax_model.safetensors", "model.safetensors"] if beside else ["model.safetensors"])
    converted = Path(mnt, "safetensors", "flax_model.safetensors" if beside else "model.safetensors")
    with safe_open(str(converted), "np") as opened:
        assert {key: opened.get_tensor(key).tobytes() for key in opened.keys()} == {  # noqa: SIM118 (safe_open is no mapping)
            name: array.tobytes() for name, array in tree.items()
        }
    if beside:
        assert Path(mnt, "safetensors", "model.safetensors").read_bytes() == (repo / "model.safetensors").read_bytes()


def test_a_sharded_set_beside_a_safetensors_set_is_named_flax_model_as_one(tmp_path: Path, mount: MountFn) -> None:
    """The repository holds model.safetensors.index.json: the Flax set's index and every shard take their own names."""
    from safetensors.numpy import save_file

    repo = tmp_path / "repo"
    repo.mkdir()
    params = state()["params"]
    weight_map = shards(repo, params, 100)
    save_file({"w": np.ones(2, np.float32)}, str(repo / "model-00001-of-00001.safetensors"))
    index = {"metadata": {"total_size": 8}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}
    (repo / "model.safetensors.index.json").write_text(json.dumps(index))
    mnt = mount(str(repo), options=["view=safetensors"])
    names = set(os.listdir(Path(mnt, "safetensors")))
    converted = {name.replace(".msgpack", ".safetensors") for name in set(weight_map.values())}
    assert names == {"model.safetensors.index.json", "model-00001-of-00001.safetensors"} | converted | {
        "flax_model.safetensors.index.json"
    }
    flax_index = json.loads(Path(mnt, "safetensors", "flax_model.safetensors.index.json").read_bytes())
    assert set(flax_index["weight_map"].values()) == converted
    for name, file in flax_index["weight_map"].items():
        assert safetensors_bytes(Path(mnt, "safetensors", file))[name] == np.asarray(dict(flat(params))[name]).tobytes()


def test_a_msgpack_that_is_not_flax_s_stays_in_files(tmp_path: Path, mount: MountFn) -> None:
    from safetensors.numpy import save_file

    repo = tmp_path / "repo"
    repo.mkdir()
    save_file({"w": np.arange(3, dtype=np.float32)}, str(repo / "model.safetensors"))
    (repo / "settings.msgpack").write_bytes(msgpack.packb({"lr": 0.1, "names": ["a", "b"]}))
    (repo / "list.msgpack").write_bytes(msgpack.packb([1, 2, 3]))
    mnt = mount(str(repo))
    assert Path(mnt, "tensors", "w").read_bytes() == np.arange(3, dtype=np.float32).tobytes()
    for name in ("settings.msgpack", "list.msgpack"):
        assert Path(mnt, "files", name).read_bytes() == (repo / name).read_bytes()
    info = stfs_command("info", "--json", str(repo))
    assert info.returncode == 0 and [m["name"] for m in json.loads(info.stdout)["models"]] == [""], info.stderr


def array_ext(shape: tuple[int, ...], dtype: str, data: bytes, code: int = 1) -> Any:
    """An array as flax's ``_msgpack_ext_pack`` frames one, with any dtype name (for the refusals flax cannot write)."""
    return msgpack.ExtType(code, msgpack.packb((shape, dtype, data), use_bin_type=True))


def refused(tmp_path: Path, data: bytes) -> str:
    """The one line stfs refuses the ``.msgpack`` holding ``data`` with (flax's reader refusing it too, or reading
    what stfs cannot serve)."""
    source = tmp_path / "model.msgpack"
    source.write_bytes(data)
    with pytest.raises(errors.FormatError) as caught:
        read_header(str(source))
    line = caught.value.message
    assert str(source) in line and "\n" not in line
    return line


def test_what_a_tensor_file_cannot_serve_is_refused_in_one_line(tmp_path: Path) -> None:
    complex128 = serialization.to_bytes({"c": np.ones(2, np.complex128)})
    assert "'complex128'" in refused(tmp_path, complex128) and "tensor 'c'" in refused(tmp_path, complex128)
    strings = serialization.to_bytes({"s": np.array(["ab", "c"])})
    assert "'str64'" in refused(tmp_path, strings)
    objects = msgpack.packb({"o": array_ext((1,), "object", bytes(8))}, use_bin_type=True)
    assert "'object'" in refused(tmp_path, objects)
    good = serialization.to_bytes(state())
    for cut in (1, 100, len(good) // 2, len(good) - 1):
        with pytest.raises(Exception):  # noqa: B017 (flax's reader refuses it too, with msgpack's own errors)
            serialization.msgpack_restore(good[:cut])
        assert "FlaxTruncated" in refused(tmp_path, good[:cut]) or "InvalidMsgpack" in refused(tmp_path, good[:cut])
    short = msgpack.packb({"w": array_ext((4,), "float32", bytes(12))}, use_bin_type=True)
    with pytest.raises(ValueError):
        serialization.msgpack_restore(short)
    assert "tensor 'w'" in refused(tmp_path, short) and "16 bytes, it holds 12" in refused(tmp_path, short)


def test_remote_info_reads_the_framing_by_range_never_the_arrays(nginx: Nginx, tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    tree = {"layers": {str(i): {"kernel": rng.standard_normal((256, 256)).astype(np.float32)} for i in range(32)}}
    local = write(tmp_path / "flax_model.msgpack", tree)
    assert local.stat().st_size > 8 * MIB
    url = nginx.put("flax_model.msgpack", local.read_bytes())
    nginx.log.clear()
    result = run([sys.executable, "-m", "stfs", "info", "--json", url])
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["models"][0]["tensors"]) == 32
    transfer = nginx.log.transfer()
    assert transfer.bytes <= 32 * 128 * 1024 + MIB, transfer  # a window of framing a tensor at most
    header = read_header(str(local))
    for entry in nginx.log.entries():  # the first speculative read aside, no request starts inside an array
        lo = int(entry.range.removeprefix("bytes=").partition("-")[0])
        assert not any(t.begin <= lo < t.end for t in header.tensors), entry.range


def test_the_fuzzer_finds_nothing_in_a_short_run(tmp_path: Path) -> None:
    """fuzz/fuzz_flax.py: mutations of flax-written files, each refused in one line or read as msgpack_restore reads
    it, in a worker with a memory cap and a timeout."""
    assert "accepted: " in short_fuzz_run("fuzz_flax.py", tmp_path, 6, 7)
