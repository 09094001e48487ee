"""PyTorch checkpoints mounted (SPEC §12): files written by the real ``torch.save``, read through real mounts, each
tensor's bytes checked against ``t.contiguous()``; a ``.bin``-only folder, sharded sets, the older layout, a pickle
whose payload would act if it were loaded, and TorchScript refused."""

from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import IN_CI, MountFn, refusal, run

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(180)


def raw(tensor: object) -> bytes:
    """The bytes of ``tensor``'s values in C order, as safetensors stores them."""
    flat = tensor.contiguous().reshape(-1)  # type: ignore[attr-defined]
    return bytes(flat.view(torch.uint8).numpy().tobytes()) if flat.numel() else b""


def nested(mnt: str | Path, name: str, folder: str = "tensors") -> str:
    return os.path.join(mnt, folder, *name.split("."))


class Net(torch.nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage, two names
        self.register_buffer("steps", torch.arange(5, dtype=torch.int64))


def state_dict() -> dict[str, object]:
    torch.manual_seed(0)
    found = dict(Net().state_dict())
    found["half"] = torch.randn(3, 5).to(torch.float16)
    found["brain"] = torch.randn(4, 2).to(torch.bfloat16)
    found["scalar"] = torch.tensor(2.5)
    found["empty"] = torch.zeros(0, 3)
    found["flags"] = torch.tensor([True, False, True])
    return found


def check_tensors(mnt: str | Path, tensors: dict[str, object], source: Path) -> None:
    for name, tensor in tensors.items():
        path = nested(mnt, name)
        with open(path, "rb") as stream:
            assert stream.read() == raw(tensor), name
        assert os.path.getsize(path) == len(raw(tensor))
        assert os.getxattr(path, "user.pytorch.name") == name.encode()
        assert json.loads(os.getxattr(path, "user.pytorch.shape")) == list(tensor.shape)  # type: ignore[attr-defined]
        assert os.getxattr(path, "user.pytorch.file") == str(source).encode()
        offset = int(os.getxattr(path, "user.pytorch.offset"))
        if raw(tensor):
            with open(source, "rb") as stream:
                stream.seek(offset)
                assert stream.read(len(raw(tensor))) == raw(tensor), name


def test_a_state_dict_mounts_every_tensor_with_its_bytes(mount: MountFn, tmp_path: Path) -> None:
    tensors = state_dict()
    path = tmp_path / "model.pt"
    torch.save(tensors, path)
    mnt = mount(str(path))
    check_tensors(mnt, tensors, path)
    assert os.getxattr(nested(mnt, "half"), "user.pytorch.dtype") == b"F16"
    assert os.getxattr(nested(mnt, "brain"), "user.pytorch.dtype") == b"BF16"
    assert os.getxattr(nested(mnt, "flags"), "user.pytorch.dtype") == b"BOOL"
    assert os.listxattr(nested(mnt, "half")) == [
        "user.pytorch.name",
        "user.pytorch.dtype",
        "user.pytorch.shape",
        "user.pytorch.file",
        "user.pytorch.offset",
    ]
    # tied weights: two files on one range
    assert os.getxattr(nested(mnt, "head.weight"), "user.pytorch.offset") == os.getxattr(
        nested(mnt, "embed.weight"), "user.pytorch.offset"
    )
    assert Path(mnt, "metadata", "format").read_text() == "pt\n"
    assert Path(mnt, "files", "model.pt").read_bytes() == path.read_bytes()


def test_header_json_is_the_equivalent_safetensors_header(mount: MountFn, tmp_path: Path) -> None:
    tensors = state_dict()
    path = tmp_path / "pytorch_model.bin"
    torch.save(tensors, path)
    mnt = mount(str(path))
    document = json.loads(Path(mnt, "header.json").read_bytes())
    assert document.pop("__metadata__") == {"format": "pt"}
    assert list(document) == list(tensors)  # the order the checkpoint names them
    at = 0
    for name, tensor in tensors.items():
        assert document[name]["shape"] == list(tensor.shape)  # type: ignore[attr-defined]
        assert document[name]["data_offsets"] == [at, at + len(raw(tensor))]
        at += len(raw(tensor))
    result = run(["jq", "-r", '.["half"].dtype', str(Path(mnt, "header.json"))])
    assert result.stdout.strip() == "F16"


def test_the_older_layout_mounts_the_same(mount: MountFn, tmp_path: Path) -> None:
    tensors = state_dict()
    path = tmp_path / "old.pth"
    torch.save(tensors, path, _use_new_zipfile_serialization=False)
    mnt = mount(str(path))
    check_tensors(mnt, tensors, path)


def test_a_bin_only_folder_mounts_its_checkpoint_and_skips_other_bin_files(mount: MountFn, tmp_path: Path) -> None:
    folder = tmp_path / "repo"
    folder.mkdir()
    tensors = state_dict()
    torch.save(tensors, folder / "pytorch_model.bin")
    torch.save({"learning_rate": 0.1, "epochs": 3}, folder / "training_args.bin")  # a pickle with no tensor
    (folder / "tokenizer.bin").write_bytes(os.urandom(4096))  # not a checkpoint at all
    (folder / "config.json").write_text('{"model_type": "net"}\n')
    mnt = mount(str(folder))
    assert sorted(os.listdir(mnt)) == ["files", "header.json", "metadata", "tensors"]
    check_tensors(mnt, tensors, folder / "pytorch_model.bin")
    assert sorted(os.listdir(Path(mnt, "files"))) == [
        "config.json",
        "pytorch_model.bin",
        "tokenizer.bin",
        "training_args.bin",
    ]


def save_halves(folder: Path, tensors: dict[str, object], first: int) -> dict[str, str]:
    """``tensors`` saved as two shards in ``folder``, the first ``first`` of them in the first: the weight map."""
    names = list(tensors)
    halves = {"pytorch_model-00001-of-00002.bin": names[:first], "pytorch_model-00002-of-00002.bin": names[first:]}
    weight_map = {}
    for shard, members in halves.items():
        torch.save({name: tensors[name].clone() for name in members}, folder / shard)  # type: ignore[attr-defined]
        weight_map.update(dict.fromkeys(members, shard))
    return weight_map


def test_a_sharded_set_of_checkpoints_mounts_as_one_model(mount: MountFn, tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    folder.mkdir()
    tensors = state_dict()
    weight_map = save_halves(folder, tensors, 5)
    index = {"metadata": {"total_size": sum(len(raw(t)) for t in tensors.values())}, "weight_map": weight_map}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    mnt = mount(str(folder))
    assert sorted(os.listdir(mnt)) == ["files", "header.json", "index.json", "metadata", "shards", "tensors"]
    for name, tensor in tensors.items():
        assert Path(nested(mnt, name)).read_bytes() == raw(tensor), name
    document = json.loads(Path(mnt, "header.json").read_bytes())
    assert document["half"]["file"] == weight_map["half"]
    assert sorted(os.listdir(Path(mnt, "shards"))) == sorted(set(weight_map.values()))


class Payload:
    """What a hostile checkpoint carries: loading it without weights_only would create ``target``."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.target, "w"))


def test_a_payload_in_the_pickle_never_runs(mount: MountFn, tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    path = tmp_path / "hostile.pt"
    weight = torch.randn(3, 4)
    torch.save({"weight": weight, "payload": Payload(str(target))}, path)
    assert not target.exists()
    mnt = mount(str(path))
    assert Path(nested(mnt, "weight")).read_bytes() == raw(weight)
    assert Path(mnt, "header.json").read_bytes()
    result = run([sys.executable, "-m", "stfs", "info", str(path)])
    assert result.returncode == 0, result.stderr
    assert not target.exists()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit is deprecated, and still what wrote them
def test_torchscript_is_refused_in_one_line(tmp_path: Path, require_fuse: None) -> None:
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(3, 2)), str(path))
    result = refusal(path, tmp_path)
    assert result.returncode == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert str(path) in line and "TorchScript" in line and "Traceback" not in line


def strided() -> dict[str, object]:
    torch.manual_seed(1)
    base = torch.randn(64, 48)
    return {
        "transposed": torch.randn(96, 80).t(),  # a transposed weight: every C-order row a column of the storage
        "sliced": base[3:60:5, 7::3],  # a slice with steps, at an offset into its storage
        "column": base[:, 5],  # one column: a stride of 48
        "expanded": torch.randn(6, 1).expand(6, 10),  # a stride of 0
        "permuted": torch.randn(5, 6, 7).to(torch.bfloat16).permute(2, 0, 1),
        "contiguous": base,  # shares the storage with the slices
    }


def test_strided_tensors_are_served_in_c_order(mount: MountFn, tmp_path: Path) -> None:
    import random

    import numpy as np

    tensors = strided()
    path = tmp_path / "views.pt"
    torch.save(tensors, path)
    mnt = mount(str(path), options=["view=npy,view=f32"])
    chooser = random.Random(7)
    for name, tensor in tensors.items():
        expected = raw(tensor)
        file = nested(mnt, name)
        assert os.path.getsize(file) == len(expected), name
        assert Path(file).read_bytes() == expected, name
        descriptor = os.open(file, os.O_RDONLY)
        try:
            for _ in range(40):
                offset = chooser.randrange(len(expected) + 8)
                size = chooser.randrange(1, len(expected) + 16)
                assert os.pread(descriptor, size, offset) == expected[offset : offset + size], (name, offset, size)
        finally:
            os.close(descriptor)
        values = tensor.contiguous().float().numpy()  # type: ignore[attr-defined]
        assert np.array_equal(np.fromfile(nested(mnt, name, "f32"), dtype="<f4").reshape(values.shape), values)
        if name != "permuted":  # BF16's .npy is float32 too: checked through f32/
            assert np.array_equal(np.load(nested(mnt, name, "npy") + ".npy"), values), name
    assert (
        int(os.getxattr(nested(mnt, "sliced"), "user.pytorch.offset"))
        == int(os.getxattr(nested(mnt, "contiguous"), "user.pytorch.offset")) + (3 * 48 + 7) * 4
    )


def test_unsafe_globals_are_warned_at_mount_and_fail_check(tmp_path: Path, require_fuse: None) -> None:
    target = tmp_path / "pwned"
    path = tmp_path / "hostile.pt"
    torch.save({"weight": torch.randn(2, 3), "payload": Payload(str(target))}, path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = run([sys.executable, "-m", "stfs", "mount", str(path), str(mnt)])
    try:
        assert result.returncode == 0, result.stderr
        [line] = [line for line in result.stderr.splitlines() if "'io.open'" in line]
        assert line.startswith("stfs: warning: ") and str(path) in line and "weights_only" in line
    finally:
        run([sys.executable, "-m", "stfs", "unmount", str(mnt)])
    result = run([sys.executable, "-m", "stfs", "check", str(path)])
    assert result.returncode == 1, result.stdout
    assert "'io.open'" in result.stdout and "would import and call it" in result.stdout
    assert not target.exists()
    clean = tmp_path / "clean.pt"
    torch.save({"weight": torch.randn(2, 3)}, clean)
    result = run([sys.executable, "-m", "stfs", "check", str(clean)])
    assert result.returncode == 0 and result.stdout == f"{clean}: ok (1 tensors)\n"


def test_view_safetensors_is_the_repository_as_safetensors(mount: MountFn, tmp_path: Path) -> None:
    from safetensors import safe_open

    folder = tmp_path / "repo"
    folder.mkdir()
    tensors = {**state_dict(), **strided()}
    torch.save(tensors, folder / "pytorch_model.bin")
    (folder / "config.json").write_text('{"model_type": "net"}\n')
    sharded = folder / "big"
    sharded.mkdir()
    weight_map = save_halves(sharded, tensors, 6)
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    mnt = mount(str(folder), options=["view=safetensors"])
    assert sorted(os.listdir(Path(mnt, "safetensors"))) == ["big", "config.json", "model.safetensors"]
    assert sorted(os.listdir(Path(mnt, "safetensors", "big"))) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    with safe_open(str(Path(mnt, "safetensors", "model.safetensors")), framework="pt") as opened:
        assert opened.metadata() == {"format": "pt"}
        assert list(opened.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(opened.get_tensor(name), tensor.contiguous()), name  # type: ignore[attr-defined]
    index = json.loads(Path(mnt, "safetensors", "big", "model.safetensors.index.json").read_text())
    for name, tensor in tensors.items():
        shard = index["weight_map"][name]
        with safe_open(str(Path(mnt, "safetensors", "big", shard)), framework="pt") as opened:
            assert torch.equal(opened.get_tensor(name), tensor.contiguous()), name  # type: ignore[attr-defined]


class HyperParameters(dict):  # type: ignore[type-arg]
    """A class of the training code, as Lightning's ``AttributeDict`` is: outside weights_only's allow-list."""


def test_a_lightning_style_ckpt_in_pickle_protocol_4_mounts_its_state_dict(mount: MountFn, tmp_path: Path) -> None:
    """A ``.ckpt`` as Lightning saves one: the model under ``state_dict``, beside optimizer states (tensors too) and
    hyper-parameters of a class of the trainer's own; written with ``pickle_protocol=4``."""
    tensors = {f"model.{name}": tensor for name, tensor in state_dict().items()}
    checkpoint = {
        "epoch": 3,
        "global_step": 1200,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": tensors,
        "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(10, 8)}}, "param_groups": [{"lr": 1e-3}]}],
        "hyper_parameters": HyperParameters(lr=1e-3, layers=2),
    }
    path = tmp_path / "epoch=3-step=1200.ckpt"
    torch.save(checkpoint, path, pickle_protocol=4)
    assert path.read_bytes()[:2] == b"PK"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = run([sys.executable, "-m", "stfs", "mount", str(path), str(mnt)])
    try:
        assert result.returncode == 0, result.stderr
        assert "HyperParameters" in result.stderr and "weights_only" in result.stderr  # named, still mounted
        check_tensors(mnt, tensors, path)
        assert sorted(os.listdir(Path(mnt, "tensors"))) == ["model"]  # the state_dict, not the optimizer's state
        assert set(json.loads(Path(mnt, "header.json").read_bytes())) == {"__metadata__", *tensors}
    finally:
        run([sys.executable, "-m", "stfs", "unmount", str(mnt)])


def test_view_safetensors_keeps_a_safetensors_file_the_repository_already_has(mount: MountFn, tmp_path: Path) -> None:
    """A repository shipping both ``pytorch_model.bin`` and ``model.safetensors`` (many do): ``safetensors/`` keeps
    the real ``model.safetensors``, not one made from the pickle, and makes the others' files."""
    from safetensors.torch import save_file

    folder = tmp_path / "both"
    folder.mkdir()
    tensors = state_dict()
    torch.save(tensors, folder / "pytorch_model.bin")
    real = {"only.in.the.real.file": torch.ones(3)}
    save_file(real, str(folder / "model.safetensors"))
    torch.save({"w": torch.zeros(2, 2)}, folder / "extra.pt")
    mnt = mount(str(folder), options=["view=safetensors"])
    assert sorted(os.listdir(Path(mnt, "safetensors"))) == ["extra.safetensors", "model.safetensors"]
    served = Path(mnt, "safetensors", "model.safetensors").read_bytes()
    assert served == (folder / "model.safetensors").read_bytes()
    from safetensors import safe_open

    with safe_open(str(Path(mnt, "safetensors", "extra.safetensors")), framework="pt") as opened:
        assert torch.equal(opened.get_tensor("w"), torch.zeros(2, 2))


LPIPS_WHEEL = Path(__file__).parent / ".wheels" / "lpips-0.1.4-py3-none-any.whl"  # scripts/setup.sh, .ci/run


@pytest.mark.parametrize(
    ("member", "count"),
    [("lpips/weights/v0.1/alex.pth", 5), ("lpips/weights/v0.1/vgg.pth", 5), ("lpips/weights/v0.0/squeeze.pth", 7)],
)
def test_lpips_weights_mount_with_torchs_names_and_bytes(
    mount: MountFn, tmp_path: Path, member: str, count: int
) -> None:
    """lpips 0.1.4's weights: torch.save's older layout, protocol 2, Python 2 strings, the state dict built as
    ``OrderedDict([[name, tensor], ...])`` (pairs as lists) and a CUDA location: mounted under the names
    torch.load(weights_only=True) gives (``lin0.model.1.weight``, ...), each file the bytes it loads."""
    if not LPIPS_WHEEL.exists():
        if IN_CI:
            pytest.fail(f"{LPIPS_WHEEL} is missing in CI (.ci/run downloads it)")
        pytest.skip("python3 -m pip download --no-deps lpips==0.1.4 -d tests/.wheels (scripts/setup.sh)")
    path = tmp_path / member.replace("/", "_")
    with zipfile.ZipFile(LPIPS_WHEEL) as wheel:
        path.write_bytes(wheel.read(member))
    expected = torch.load(path, weights_only=True, map_location="cpu")
    assert list(expected) == [f"lin{i}.model.1.weight" for i in range(count)]
    mnt = mount(str(path))
    check_tensors(mnt, dict(expected), path)
    assert list(json.loads(Path(mnt, "header.json").read_bytes())) == ["__metadata__", *expected]
    assert sorted(os.listdir(Path(mnt, "tensors"))) == [f"lin{i}" for i in range(count)]
