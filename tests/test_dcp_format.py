"""PyTorch Distributed Checkpoints (SPEC §13): folders written by the real ``torch.distributed.checkpoint.save``, in
one process and from two ranks of a gloo process group (``torch.multiprocessing.spawn``) whose DTensors are sharded
along each dimension; every tensor read through a real mount and compared with what
``format_utils.dcp_to_torch_save`` gives, loaded by ``torch.load``; bytes entries in ``metadata/``; ``--view
safetensors``, info, check, check --values, diff against the model the checkpoint was saved from; each refusal one
line naming the rule (each broken checkpoint made by torch's own writer, or its ``.metadata`` re-pickled by
``pickle`` from torch's own dataclasses, as ``FileSystemWriter`` pickles it)."""

from __future__ import annotations

import datetime
import gzip
import json
import os
import pickle
import random
import shutil
import socket
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

from tests.helpers import MountFn, refusal, run, stfs_command

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def single_state() -> dict[str, Any]:
    """A state dict of every kind of entry one process saves: tensors of many dtypes and shapes (a transpose,
    which torch.save stores strided; a slice of a larger tensor), nested names, bytes entries."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7
    return {
        "model": {
            "embed.weight": base,
            "half": base[:2].to(torch.float16),
            "bf16": base[1:3].to(torch.bfloat16),
            "transposed": base.t(),
            "slice": torch.arange(100, dtype=torch.int32)[10:20],
            "flags": torch.tensor([True, False, True]),
            "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 3),
            "f8": (base[0] / 4).to(torch.float8_e4m3fn),
            "ints": torch.arange(-3, 3, dtype=torch.int64).reshape(2, 3),
        },
        "wide": torch.ones(2, dtype=torch.complex128),
        "step": 1234,
        "lr": 0.0003,
        "name": "adamw",
        "schedule": {"milestones": [10, 20], "gamma": 0.5},
    }


def save(folder: Path, state: dict[str, Any], **writer: Any) -> Path:
    """``torch.distributed.checkpoint.save`` of ``state`` into ``folder`` from this one process."""
    with warnings.catch_warnings():  # "torch.distributed is disabled ...: assuming ... a single process"
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder), **writer))
    return folder


def full_tensors() -> dict[str, Any]:
    """The tensors the two ranks shard, whole (what the checkpoint was saved from)."""
    rows = torch.arange(35, dtype=torch.float32).reshape(7, 5) / 3
    columns = torch.arange(24, dtype=torch.float32).reshape(4, 6).to(torch.bfloat16)
    cube = (torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3) - 7).to(torch.float16)
    with_nan = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    with_nan[4, 1] = float("nan")
    return {
        "layers.0.rows": rows,
        "layers.0.columns": columns,
        "layers.0.cube": cube,
        "layers.0.deep": cube.float(),
        "replicated": torch.arange(5, dtype=torch.int64),
        "nan": with_nan,
    }


def _rank(rank: int, world: int, port: int, folder: str) -> None:
    """One rank of a gloo group: each tensor a DTensor sharded along one dimension (rows unevenly, 7 over 2),
    one replicated, and a step counter; all saved together."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        placements = {
            "layers.0.rows": Shard(0),
            "layers.0.columns": Shard(1),
            "layers.0.cube": Shard(1),
            "layers.0.deep": Shard(2),
            "replicated": Replicate(),
            "nan": Shard(0),
        }
        state: dict[str, Any] = {
            name: distribute_tensor(tensor, mesh, [placements[name]]) for name, tensor in full_tensors().items()
        }
        state["train.step"] = 17
        dcp.save(state, checkpoint_id=folder)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint two ranks saved: its folder holds ``.metadata``, ``__0_0.distcp`` and ``__1_0.distcp``."""
    folder = tmp_path_factory.mktemp("sharded") / "checkpoint"
    torch.multiprocessing.spawn(_rank, args=(2, free_port(), str(folder)), nprocs=2)
    return folder


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tmp_path_factory.mktemp("single") / "checkpoint", single_state())


def reference(folder: Path, tmp_path: Path) -> dict[str, Any]:
    """What ``dcp_to_torch_save`` makes of the checkpoint, loaded by ``torch.load``, by fully qualified name."""
    target = tmp_path / f"{folder.name}.pt"
    dcp_to_torch_save(str(folder), str(target))
    found: dict[str, Any] = {}

    def walk(value: Any, name: str) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(inner, f"{name}.{key}" if name else str(key))
        else:
            found[name] = value

    walk(torch.load(target, weights_only=False), "")
    return found


def raw(tensor: Any) -> bytes:
    """A tensor's bytes in C order."""
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def tensor_file(mnt: str, name: str, folder: str = "tensors") -> Path:
    return Path(mnt, folder, *name.split("."))


def test_every_tensor_of_one_process_is_a_file_of_dcp_to_torch_saves_bytes(
    single: Path, tmp_path: Path, mount: MountFn
) -> None:
    wanted = reference(single, tmp_path)
    mnt = mount(str(single))
    tensors = {name: value for name, value in wanted.items() if isinstance(value, torch.Tensor) and name != "wide"}
    assert len(tensors) == 10
    for name, tensor in tensors.items():
        path = tensor_file(mnt, name)
        assert path.read_bytes() == raw(tensor), name
        assert os.getxattr(path, "user.dcp.name").decode() == name
        assert json.loads(os.getxattr(path, "user.dcp.shape")) == list(tensor.shape)
        assert os.getxattr(path, "user.dcp.chunks") == (b"1" if tensor.numel() else b"0")
    header = json.loads(Path(mnt, "header.json").read_bytes())
    assert [name for name in header if name != "__metadata__"] == [f"model.{name}" for name in single_state()["model"]]
    assert header["model.f8"]["dtype"] == "F8_E4M3" and header["model.flags"]["dtype"] == "BOOL"
    metadata = {name: Path(mnt, "metadata", name).read_text() for name in os.listdir(Path(mnt, "metadata"))}
    assert metadata["format"] == "pt\n" and metadata["step"] == "1234\n" and metadata["lr"] == "0.0003\n"
    assert metadata["name"] == "adamw\n" and metadata["schedule.milestones"].startswith("a list of 2, ")
    assert sorted(os.listdir(Path(mnt, "files"))) == [".metadata", "__0_0.distcp"]
    transposed = tensor_file(mnt, "model.transposed")  # torch.save stored it strided: gathered
    assert os.getxattr(transposed, "user.dcp.file").decode() == str(single / "__0_0.distcp")


def test_every_sharded_tensor_is_gathered_from_its_chunks(sharded: Path, tmp_path: Path, mount: MountFn) -> None:
    wanted = reference(sharded, tmp_path)
    assert sorted(os.listdir(sharded)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    mnt = mount(str(sharded), options=["view=f32"])
    chunks = {"replicated": b"1"}
    rng = random.Random(3)
    for name, whole in full_tensors().items():
        expected = raw(wanted[name])
        assert expected == raw(whole)
        path = tensor_file(mnt, name)
        assert path.read_bytes() == expected, name
        assert os.getxattr(path, "user.dcp.chunks") == chunks.get(name, b"2")
        with open(path, "rb") as stream:  # reads that start and end inside elements, and inside chunks
            for _ in range(40):
                begin = rng.randrange(len(expected))
                end = rng.randrange(begin, len(expected) + 1)
                assert os.pread(stream.fileno(), end - begin, begin) == expected[begin:end], (name, begin, end)
        if whole.is_floating_point():  # the views read the gathered bytes too
            f32 = np.fromfile(tensor_file(mnt, name, "f32"), dtype=np.float32)
            assert np.array_equal(f32, whole.float().reshape(-1).numpy(), equal_nan=True), name
    assert Path(mnt, "metadata", "train.step").read_text() == "17\n"
    assert sorted(os.listdir(Path(mnt, "files"))) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_the_safetensors_view_is_the_checkpoint_as_one_safetensors_file(sharded: Path, mount: MountFn) -> None:
    from safetensors.torch import load_file

    mnt = mount(str(sharded), options=["view=safetensors"])
    assert sorted(os.listdir(Path(mnt, "safetensors"))) == ["__0_0.distcp", "__1_0.distcp", "model.safetensors"]
    loaded = load_file(str(Path(mnt, "safetensors", "model.safetensors")))
    assert sorted(loaded) == sorted(full_tensors())
    for name, whole in full_tensors().items():
        assert raw(loaded[name]) == raw(whole), name


def test_info_check_and_check_values(sharded: Path) -> None:
    info = stfs_command("info", "--json", str(sharded))
    assert info.returncode == 0, info.stderr
    (model,) = json.loads(info.stdout)["models"]
    assert {tensor["name"]: tensor["shape"] for tensor in model["tensors"]} == {
        name: list(tensor.shape) for name, tensor in full_tensors().items()
    }
    assert model["metadata"] == {"format": "pt", "train.step": "17"}
    check = stfs_command("check", str(sharded / ".metadata"))
    assert check.returncode == 0 and "ok (6 tensors)" in check.stdout, check.stdout + check.stderr
    values = stfs_command("check", "--values", str(sharded))
    assert values.returncode == 1
    assert "'nan': 1 NaN, 0 +inf, 0 -inf, the first at [4, 1]" in values.stdout, values.stdout


def test_diff_against_the_model_it_was_saved_from(sharded: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = full_tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    same = stfs_command("diff", str(sharded), str(tmp_path / "model.safetensors"))
    assert same.returncode == 0, same.stdout + same.stderr
    tensors["layers.0.columns"] = tensors["layers.0.columns"].clone()
    tensors["layers.0.columns"][2, 4] += 1  # in the second rank's chunk
    save_file(tensors, str(tmp_path / "changed.safetensors"))
    result = stfs_command("diff", "--json", str(sharded), str(tmp_path / "changed.safetensors"))
    assert result.returncode == 1
    found = {tensor["name"]: tensor for tensor in json.loads(result.stdout)["tensors"]}
    assert found["layers.0.columns"]["status"] == "different" and found["layers.0.columns"]["where"] == [2, 4]
    assert {found[name]["status"] for name in tensors if name != "layers.0.columns"} == {"identical"}


def test_a_dtype_safetensors_lacks_is_left_out_with_a_warning(single: Path) -> None:
    info = stfs_command("info", "--json", str(single))
    (model,) = json.loads(info.stdout)["models"]
    assert "wide" not in {tensor["name"] for tensor in model["tensors"]}
    assert any("'wide' left out: dtype torch.complex128" in line for line in model["warnings"]), model["warnings"]


def test_a_folder_of_checkpoints_is_a_model_each(single: Path, sharded: Path, tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    shutil.copytree(single, tmp_path / "runs" / "step100")
    shutil.copytree(sharded, tmp_path / "runs" / "step200")
    (tmp_path / "runs" / "notes").mkdir()
    (tmp_path / "runs" / "notes" / ".metadata").write_text("not a checkpoint\n")  # left in files/
    save_file({"w": np.ones(3, np.float32)}, str(tmp_path / "runs" / "final.safetensors"))
    info = stfs_command("info", "--json", str(tmp_path / "runs"))
    assert info.returncode == 0, info.stderr
    names = [model["name"] for model in json.loads(info.stdout)["models"]]
    assert names == ["final", "step100", "step200"]


def test_a_remote_checkpoint_mounts(sharded: Path, nginx: Any, mount: MountFn) -> None:
    urls = {file.name: nginx.put(f"sharded/{file.name}", file.read_bytes()) for file in sharded.iterdir()}
    mnt = mount(urls[".metadata"])
    for name, whole in full_tensors().items():
        assert tensor_file(mnt, name).read_bytes() == raw(whole), name
    assert os.getxattr(tensor_file(mnt, "layers.0.rows"), "user.dcp.file").decode() == urls["__0_0.distcp"]
    assert sorted(os.listdir(Path(mnt, "files"))) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_info_of_a_remote_checkpoint_reads_its_framing_not_its_tensors(nginx: Any, tmp_path: Path) -> None:
    from stfs.formats.dcp.stored import HEAD, TAIL
    from stfs.sources.remote import FIRST_READ

    count = 16
    folder = save(tmp_path / "big", {f"layer.{k}": torch.full((256, 1024), float(k)) for k in range(count)})
    urls = {file.name: nginx.put(f"big/{file.name}", file.read_bytes()) for file in folder.iterdir()}
    nginx.log.clear()
    info = run([sys.executable, "-m", "stfs", "info", "--json", urls[".metadata"]])
    assert info.returncode == 0, info.stderr
    document = json.loads(info.stdout)
    assert len(document["models"][0]["tensors"]) == count
    transfer = nginx.log.transfer()
    # stfs counts the bodies it reads, not the error page of its one 404: Megatron's metadata.json looked for
    assert document["transfer"]["bytes"] == sum(entry.body_bytes for entry in nginx.log.entries() if entry.status < 400)
    # .metadata, the first read of the one .distcp (the source's own, as of every file), each chunk's framing
    framing = (folder / ".metadata").stat().st_size + FIRST_READ + count * (HEAD + TAIL)
    weights = count * 256 * 1024 * 4
    assert transfer.bytes <= framing < weights // 20 and transfer.requests <= count + 4, (transfer, framing)


def grid_pieces(
    rng: random.Random, whole: Any, files: dict[str, bytearray], most: int | None = None, transposed: float = 0.5
) -> tuple[list[Any], list[list[int]]]:
    """``whole`` (an array) cut into a random grid of chunks (at most ``most`` cuts a dimension), each chunk's bytes
    appended to one of ``files``, stored as a transpose is (strides in Fortran order) with the chance ``transposed``:
    the chunks as ``assemble.Piece``s, and the cuts."""
    import itertools

    from stfs.formats.dcp import assemble
    from stfs.formats.pytorch import Tensor

    shape = whole.shape
    cuts = [[0, *sorted(rng.sample(range(1, n), rng.randint(0, min(n - 1, most or n)))), n] for n in shape]
    pieces = []
    for box in itertools.product(*[range(len(cut) - 1) for cut in cuts]):
        offsets = tuple(cut[i] for cut, i in zip(cuts, box, strict=True))
        sizes = tuple(cut[i + 1] - cut[i] for cut, i in zip(cuts, box, strict=True))
        block = whole[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]
        file = rng.choice(list(files))
        start = len(files[file])
        if len(shape) >= 2 and rng.random() < transposed:
            files[file] += np.ascontiguousarray(block.T).tobytes()
            strides = tuple(int(np.prod(sizes[:d])) for d in range(len(shape)))
        else:
            files[file] += np.ascontiguousarray(block).tobytes()
            strides = tuple(int(np.prod(sizes[d + 1 :])) for d in range(len(shape)))
        tensor = Tensor("", "U8", sizes, strides, whole.itemsize, "0", 0, start, block.nbytes)
        pieces.append(assemble.piece(file, offsets, sizes, tensor, shape))
    return pieces, cuts


@pytest.mark.parametrize("planes", [64, 0])  # whole rows of a plane at once, or every element by index
def test_any_grid_of_chunks_is_gathered_in_c_order(
    tmp_path: Path, planes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensors of 0 to 4 dimensions cut into grids of chunks, each chunk's bytes in one of three files (C order, or
    stored transposed as torch.save stores a transpose), read back over random ranges."""
    from stfs.formats.dcp import assemble

    monkeypatch.setattr(assemble, "PLANES", planes)
    rng = random.Random(5)
    for trial in range(60):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(0, 4)))
        whole = (np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape) * 7 + 1).astype(np.int32)
        files = {f"f{k}": bytearray(rng.randbytes(rng.randint(0, 40))) for k in range(3)}
        pieces, cuts = grid_pieces(rng, whole, files)
        assert assemble.covers(shape, [(part.offsets, part.sizes) for part in pieces]) is None
        for name, data in files.items():
            (tmp_path / name).write_bytes(data)

        def read(offset: int, size: int, file: str | None = None, span: tuple[int, int] | None = None) -> bytes:
            with open(tmp_path / str(file), "rb") as stream:
                return os.pread(stream.fileno(), size, offset)

        gathered = assemble.Assembled(shape, 4, tuple(sorted(pieces, key=lambda part: part.first)))
        expected = whole.tobytes()
        for _ in range(10):
            begin = rng.randrange(len(expected))
            end = rng.randrange(begin, len(expected) + 1)
            view = bytearray(end - begin)
            gathered.read_into(read, begin, memoryview(view))
            assert bytes(view) == expected[begin:end], (trial, shape, cuts, begin, end)
        if len(pieces) > 1:
            boxes = [(part.offsets, part.sizes) for part in pieces]
            assert assemble.covers(shape, boxes[1:])[0] == "hole"
            assert assemble.covers(shape, [*boxes, boxes[-1]])[0] == "overlap"


# -- refusals --------------------------------------------------------------------------------------------------------


def refused(source: Path, tmp_path: Path, rule: str) -> str:
    """``stfs mount`` and ``stfs check`` both refuse ``source`` in one line naming ``rule``: that line."""
    result = refusal(source, tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert str(source) in lines[0] and f"({rule})" in lines[0], lines[0]
    check = stfs_command("check", str(source))
    assert check.returncode == 1 and f"({rule})" in check.stdout + check.stderr
    return lines[0]


def rewritten(sharded: Path, tmp_path: Path, change: Callable[[Any], None]) -> Path:
    """A copy of the checkpoint whose ``.metadata`` is torch's ``Metadata`` changed, pickled again as
    ``FileSystemWriter`` pickles it."""
    folder = shutil.copytree(sharded, tmp_path / "checkpoint")
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    change(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return folder


def chunks_of(metadata: Any, name: str) -> list[Any]:
    return list(metadata.state_dict_metadata[name].chunks)


def test_chunks_that_overlap_are_refused(sharded: Path, tmp_path: Path, require_fuse: None) -> None:
    def overlap(metadata: Any) -> None:
        first, second = chunks_of(metadata, "layers.0.rows")
        second.offsets = torch.Size([3, 0])  # rows 3..5 where the first ends at 4: row 3 twice
        second.sizes = torch.Size([3, 5])

    line = refused(rewritten(sharded, tmp_path, overlap), tmp_path, "OverlappingChunks")
    assert "'layers.0.rows'" in line and "[0, 0] and [3, 0]" in line


def test_chunks_that_leave_a_hole_are_refused(sharded: Path, tmp_path: Path, require_fuse: None) -> None:
    def hole(metadata: Any) -> None:
        metadata.state_dict_metadata["layers.0.columns"].chunks.pop()

    line = refused(rewritten(sharded, tmp_path, hole), tmp_path, "ChunksLeaveHole")
    assert "'layers.0.columns'" in line and "12 of its 24 elements" in line


def test_a_chunk_outside_its_tensor_or_without_storage_is_refused(
    sharded: Path, tmp_path: Path, require_fuse: None
) -> None:
    def outside(metadata: Any) -> None:
        chunks_of(metadata, "layers.0.cube")[1].sizes = torch.Size([2, 3, 3])

    refused(rewritten(sharded, tmp_path / "outside", outside), tmp_path / "outside", "ChunkOutsideTensor")

    def unstored(metadata: Any) -> None:
        key = next(key for key in metadata.storage_data if key.fqn == "layers.0.deep")
        del metadata.storage_data[key]

    refused(rewritten(sharded, tmp_path / "unstored", unstored), tmp_path / "unstored", "MissingChunkStorage")


def test_a_missing_or_short_distcp_is_refused(sharded: Path, tmp_path: Path, require_fuse: None) -> None:
    missing = shutil.copytree(sharded, tmp_path / "missing" / "checkpoint")
    (missing / "__1_0.distcp").unlink()
    assert "'__1_0.distcp', which is missing" in refused(missing, tmp_path / "missing", "MissingDataFile")
    short = shutil.copytree(sharded, tmp_path / "short" / "checkpoint")
    os.truncate(short / "__0_0.distcp", 1000)
    refused(short, tmp_path / "short", "DataFileTooShort")


def test_a_chunk_that_is_no_torch_save_of_its_tensor_is_refused(
    sharded: Path, tmp_path: Path, require_fuse: None
) -> None:
    folder = shutil.copytree(sharded, tmp_path / "checkpoint")
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    stored = next(info for key, info in metadata.storage_data.items() if key.fqn == "layers.0.rows")
    with open(folder / stored.relative_path, "r+b") as stream:
        stream.seek(stored.offset + stored.length - 22)  # its zip's end of central directory record
        stream.write(bytes(22))
    line = refused(folder, tmp_path, "InvalidChunk")
    assert "'layers.0.rows'" in line and "InvalidZipArchive" in line


def test_every_cut_and_changed_byte_is_a_checkpoint_or_one_named_error(sharded: Path, tmp_path: Path) -> None:
    """``.metadata`` or a ``.distcp`` cut short or with bytes changed: read as a checkpoint, or refused by a named
    error (``StfsError``), never another exception."""
    from stfs import errors, model

    rng = random.Random(11)
    files = sorted(file.name for file in sharded.iterdir())
    outcomes: set[str] = set()
    for trial in range(300):
        folder = tmp_path / str(trial)
        shutil.copytree(sharded, folder)
        target = folder / rng.choice(files)
        data = bytearray(target.read_bytes())
        if rng.random() < 0.3:
            del data[rng.randrange(len(data)) :]
        else:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        target.write_bytes(bytes(data))
        try:
            model.resolve(str(folder))
            outcomes.add("read")
        except errors.StfsError as exc:
            outcomes.add(type(exc).__name__)
        shutil.rmtree(folder)
    assert {"read", "InvalidChunk", "DataFileTooShort"} <= outcomes, outcomes


class Gzip(dcp._extension.StreamTransformExtension):  # type: ignore[misc]
    """A stream transform for FileSystemWriter's ``_extensions``: each item gzipped."""

    @staticmethod
    def registry_name() -> str:
        return "tests.gzip"

    @staticmethod
    def from_descriptor(version: str) -> Gzip:
        return Gzip()

    def get_descriptor(self) -> str:
        return "tests.gzip/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return gzip.GzipFile(fileobj=output, mode="wb")  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return gzip.GzipFile(fileobj=input, mode="rb")  # type: ignore[return-value]


def test_transformed_storage_is_refused(tmp_path: Path, require_fuse: None) -> None:
    folder = save(tmp_path / "checkpoint", {"w": torch.ones(4, 4)}, _extensions=[Gzip()])
    line = refused(folder, tmp_path, "TransformedStorage")
    assert "tests.gzip/1" in line


def test_a_global_torch_does_not_write_is_named_by_check(sharded: Path, tmp_path: Path) -> None:
    def planner(metadata: Any) -> None:
        metadata.planner_data = {"when": datetime.date(2024, 1, 2)}

    folder = rewritten(sharded, tmp_path, planner)
    info = stfs_command("info", str(folder))
    assert info.returncode == 0 and "'datetime.date'" in info.stderr
    check = stfs_command("check", str(folder))
    assert check.returncode == 1
    assert "names the global 'datetime.date'" in check.stdout + check.stderr and "pickle.load" in check.stdout


def test_a_metadata_of_another_pickle_is_refused_and_left_in_a_folder(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    (tmp_path / "model").mkdir()
    other = tmp_path / "model" / ".metadata"
    other.write_bytes(pickle.dumps({"torch.distributed.checkpoint.metadata": 1}))
    result = stfs_command("info", str(other))
    assert result.returncode == 1 and "(NotDcpMetadata)" in result.stderr, result.stderr
    save_file({"w": np.ones(3, np.float32)}, str(tmp_path / "model" / "model.safetensors"))
    folder = stfs_command("info", "--json", str(tmp_path / "model"))
    assert folder.returncode == 0, folder.stderr
    assert [tensor["name"] for tensor in json.loads(folder.stdout)["models"][0]["tensors"]] == ["w"]
