"""GGUF sources mounted (SPEC §11): files written by gguf-py's GGUFWriter, read through real mounts, bytes checked
against gguf-py's reader, decoded values against ``gguf.quants.dequantize``; split sets, folders holding both
formats, refusals, and remote GGUF files (their headers' requests read from nginx's log)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from stfs.formats import gguf
from tests import test_gguf_format as gguf_format
from tests.helpers import MountFn, refusal, run
from tests.servers import FakeHub, Nginx
from tests.test_gguf_format import write_split_set

pytestmark = pytest.mark.timeout(180)

KINDS = [kind for kind in GGMLQuantizationType if kind in GGML_QUANT_SIZES]
NUMPY_KEEPS = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}
INTEGERS = {"I8", "I16", "I32", "I64"}


def write(path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]], **keys: str) -> Path:
    """A GGUF written by GGUFWriter (``test_gguf_format.write``) with a llama's context length, an epsilon and a
    vocabulary of three tokens, and ``keys`` as strings."""
    return gguf_format.write(
        path,
        tensors,
        **{
            "llama.context_length": (4096, GGUFValueType.UINT32),
            "llama.attention.layer_norm_rms_epsilon": (1e-5, GGUFValueType.FLOAT32),
            "tokenizer.ggml.tokens": (["<s>", "hello", "é"], GGUFValueType.ARRAY, GGUFValueType.STRING),
        },
        **{key: (value, GGUFValueType.STRING) for key, value in keys.items()},
    )


def every_type(path: Path) -> Path:
    """One tensor of two rows of three blocks of random bytes for every type gguf knows, and a Q8_0 tensor
    quantized from real values."""
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]] = {}
    for kind in KINDS:
        _, type_size = GGML_QUANT_SIZES[kind]
        blocks = np.random.default_rng(int(kind)).integers(0, 256, size=(2, 3 * type_size), dtype=np.uint8)
        tensors[f"blk.{int(kind)}.{kind.name.lower()}"] = (blocks, kind)
    values = np.random.default_rng(1).standard_normal((4, 512)).astype(np.float32)
    tensors["output.weight"] = (quants.quantize(values, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    return write(path, tensors)


def nested(mnt: str, folder: str, name: str, suffix: str = "") -> str:
    return os.path.join(mnt, folder, *name.split(".")) + suffix


def test_every_type_mounts_with_its_bytes_and_its_decoded_values(mount: MountFn, tmp_path: Path) -> None:
    path = every_type(tmp_path / "all.gguf")
    mnt = mount(str(path), options=["view=f32,view=npy,view=stats,view=png"])
    reader = GGUFReader(str(path))
    assert len(reader.tensors) == len(KINDS) + 1
    for tensor in reader.tensors:
        kind, name = tensor.tensor_type, tensor.name
        stored = bytes(tensor.data.tobytes())
        with open(nested(mnt, "tensors", name), "rb") as stream:
            assert stream.read() == stored, name
        xattrs = {
            attr: os.getxattr(nested(mnt, "tensors", name), attr) for attr in os.listxattr(nested(mnt, "tensors", name))
        }
        shape = [int(n) for n in reversed(tensor.shape)]
        assert xattrs == {
            "user.gguf.name": name.encode(),
            "user.gguf.dtype": kind.name.encode(),
            "user.gguf.shape": json.dumps(shape, separators=(",", ":")).encode(),
            "user.gguf.file": str(path).encode(),
            "user.gguf.offset": str(tensor.data_offset).encode(),
        }
        decodable = gguf.ggml_type(kind.name).dequantizable or kind.name == "F64"
        has_f32 = decodable and kind.name not in INTEGERS
        assert os.path.exists(nested(mnt, "f32", name)) == has_f32, name
        assert os.path.exists(nested(mnt, "stats", name, ".json")) == (decodable or kind.name in INTEGERS), name
        assert os.path.exists(nested(mnt, "png", name, ".png")) == (decodable or kind.name in INTEGERS), name
        if kind.name in NUMPY_KEEPS:  # npy/ keeps the stored bytes
            array = np.load(nested(mnt, "npy", name, ".npy"))
            assert array.dtype == np.dtype(NUMPY_KEEPS[kind.name]) and list(array.shape) == shape
            assert array.tobytes() == stored
        elif decodable:
            expected = quants.dequantize(np.frombuffer(stored, dtype=np.uint8), kind).astype(np.float32).reshape(shape)
            got = np.fromfile(nested(mnt, "f32", name), dtype="<f4").reshape(shape)
            assert np.array_equal(got, expected, equal_nan=True), name  # NaN where the package gives NaN
            array = np.load(nested(mnt, "npy", name, ".npy"))
            assert array.dtype == np.float32 and np.array_equal(array, expected, equal_nan=True), name
            stats = json.loads(Path(nested(mnt, "stats", name, ".json")).read_text())
            assert stats["count"] == expected.size and stats["nan"] == int(np.isnan(expected).sum()), name
        else:  # Q8_1, Q8_K, Q1_0: the package has no dequantizer for them
            assert not os.path.exists(nested(mnt, "npy", name, ".npy")), name


def test_header_json_and_metadata_are_the_key_values(mount: MountFn, tmp_path: Path) -> None:
    values = np.arange(64, dtype=np.float32).reshape(2, 32)
    path = write(tmp_path / "m.gguf", {"token_embd.weight": (values, None)}, **{"general.name": "tiny"})
    mnt = mount(str(path))
    header = json.loads(Path(mnt, "header.json").read_bytes())
    assert header["__metadata__"]["llama.context_length"] == 4096
    assert header["__metadata__"]["tokenizer.ggml.tokens"] == ["<s>", "hello", "é"]
    assert header["token_embd.weight"] == {"dtype": "F32", "shape": [2, 32], "data_offsets": [0, 256]}
    assert Path(mnt, "metadata", "llama.attention.layer_norm_rms_epsilon").read_text() == "1e-05\n"
    assert Path(mnt, "metadata", "general.name").read_text() == "tiny\n"
    assert Path(mnt, "metadata", "tokenizer.ggml.tokens").read_text() == '["<s>","hello","é"]\n'
    result = run(["jq", "-r", '.["token_embd.weight"].dtype', str(Path(mnt, "header.json"))])
    assert result.stdout == "F32\n"
    assert Path(mnt, "files", "m.gguf").read_bytes() == path.read_bytes()


def test_any_split_of_a_set_mounts_the_whole_set(mount: MountFn, tmp_path: Path) -> None:
    splits = write_split_set(tmp_path / "set")
    assert [p.name for p in splits] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    mnt = mount(str(splits[1]))
    for i in range(5):
        assert np.fromfile(nested(mnt, "tensors", f"blk.{i}.w"), dtype="<f4").tolist() == [float(i)] * 8
    header = json.loads(Path(mnt, "header.json").read_bytes())
    assert [header[f"blk.{i}.w"]["file"] for i in range(5)] == [s.name for s in splits for _ in range(2)][:5]
    assert sorted(os.listdir(Path(mnt, "shards"))) == [s.name for s in splits]
    first = json.loads(Path(mnt, "shards", splits[0].name, "header.json").read_bytes())
    assert first["__metadata__"]["split.no"] == 0 and set(first) == {"__metadata__", "blk.0.w", "blk.1.w"}
    assert sorted(os.listdir(Path(mnt, "files"))) == [s.name for s in splits]


def test_a_folder_holding_both_formats_mounts_every_model(mount: MountFn, tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    folder = tmp_path / "repo"
    write_split_set(folder / "q4")
    write(folder / "small.gguf", {"w": (np.ones((1, 32), dtype=np.float32), None)})
    save_file({"w": np.ones(3, dtype=np.float32)}, str(folder / "model.safetensors"))
    (folder / "README.md").write_text("a model\n")
    mnt = mount(str(folder))
    assert sorted(os.listdir(mnt)) == ["files", "model", "q4", "small"]
    assert os.listdir(Path(mnt, "q4")) == ["model"]  # q4/model-0000K-of-00003.gguf: the set q4/model
    assert sorted(os.listdir(Path(mnt, "q4", "model"))) == ["header.json", "metadata", "shards", "tensors"]
    assert os.getxattr(Path(mnt, "small", "tensors", "w"), "user.gguf.dtype") == b"F32"
    assert os.getxattr(Path(mnt, "model", "tensors", "w"), "user.safetensors.dtype") == b"F32"
    assert Path(mnt, "files", "README.md").read_text() == "a model\n"


def test_a_broken_file_is_refused_in_one_line(tmp_path: Path, require_fuse: None) -> None:
    path = write(tmp_path / "m.gguf", {"w": (np.ones((2, 32), dtype=np.float32), None)})
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(path.read_bytes()[:-8])  # the last tensor's bytes run past the end
    result = refusal(broken, tmp_path)
    assert result.returncode == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert str(broken) in line and "'w'" in line and "Traceback" not in line


def test_a_set_missing_a_split_is_refused_in_one_line(tmp_path: Path, require_fuse: None) -> None:
    splits = write_split_set(tmp_path / "set")
    splits[2].unlink()
    result = refusal(splits[0], tmp_path)
    assert result.returncode == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert splits[2].name in line and "missing" in line


def test_gguf_py_reads_the_file_through_the_mount(mount: MountFn, tmp_path: Path) -> None:
    path = every_type(tmp_path / "all.gguf")
    mnt = mount(str(path))
    direct, through = GGUFReader(str(path)), GGUFReader(os.path.join(mnt, "files", "all.gguf"))  # np.memmap
    assert [t.name for t in through.tensors] == [t.name for t in direct.tensors]
    for a, b in zip(direct.tensors, through.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and np.array_equal(a.data, b.data)


# -- remote ------------------------------------------------------------------------------------------------------


def vocabulary_model(path: Path, tokens: int) -> Path:
    """A GGUF whose header is megabytes: a vocabulary as Qwen's, tokens and scores and types."""
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_token_list([f"token-{i:06d}-{'x' * (i % 13)}" for i in range(tokens)])
    writer.add_token_scores([float(-i) for i in range(tokens)])
    writer.add_token_types([1] * tokens)
    writer.add_tensor("token_embd.weight", np.ones((64, 256), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_header_of_a_remote_gguf_costs_few_requests_and_never_the_data(nginx: Nginx, tmp_path: Path) -> None:
    local = vocabulary_model(tmp_path / "qwen.gguf", 151_936)
    header = gguf.read_header(lambda o, n: local.read_bytes()[o : o + n], local.stat().st_size, path=str(local))
    url = nginx.put("qwen.gguf", local.read_bytes())
    result = run([sys.executable, "-m", "stfs", "info", url, "--json"])
    assert result.returncode == 0, result.stderr
    transfer = json.loads(result.stdout)["transfer"]
    assert transfer["requests"] <= 4, transfer
    assert transfer["bytes"] <= 2 * header.header_size + (2 << 20), (transfer, header.header_size)
    for entry in nginx.log.entries():
        lo, _, hi = entry.range.removeprefix("bytes=").partition("-")
        assert int(lo) < header.data_offset, entry.range  # never a request that starts in the data


def test_a_hub_repository_of_two_quantizations(hub: FakeHub, mount: MountFn, tmp_path: Path) -> None:
    values = np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32)
    files = {}
    for kind in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0):
        path = write(tmp_path / f"m-{kind.name}.gguf", {"w": (quants.quantize(values, kind), kind)})
        files[path.name] = path.read_bytes()
    files["README.md"] = b"# two quantizations\n"
    hub.publish_repo("org", "model-GGUF", files)
    mnt = mount("hf://org/model-GGUF", options=["view=f32"])
    assert sorted(os.listdir(mnt)) == ["files", "m-Q4_0", "m-Q8_0"]
    for kind in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0):
        expected = quants.dequantize(quants.quantize(values, kind), kind)
        got = np.fromfile(os.path.join(mnt, f"m-{kind.name}", "f32", "w"), dtype="<f4").reshape(4, 256)
        assert np.array_equal(got, expected)
        assert os.getxattr(os.path.join(mnt, f"m-{kind.name}", "tensors", "w"), "user.gguf.dtype") == kind.name.encode()
    assert Path(mnt, "files", "README.md").read_bytes() == b"# two quantizations\n"
