"""Megatron-Core / NeMo ``torch_dist`` checkpoints (SPEC §16): a folder written by the real
``torch.distributed.checkpoint.save``, with ``common.pt`` written by ``torch.save`` and ``metadata.json`` as
Megatron-Core's ``dist_checkpointing.save`` writes them beside it; mounted as one model through a real mount."""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

import pytest

from tests.helpers import MountFn, stfs_command, tensor_path

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")


@pytest.fixture
def torch_dist(tmp_path: Path) -> Path:
    folder = tmp_path / "iter_0000100"
    state = {
        "decoder.layers.0.mlp.weight": torch.arange(35, dtype=torch.float32).reshape(5, 7) / 3,
        "embedding.word_embeddings.weight": torch.arange(12, dtype=torch.bfloat16).reshape(4, 3),
    }
    with warnings.catch_warnings():  # "torch.distributed is disabled ...: assuming ... a single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))
    common = {
        "args": argparse.Namespace(num_layers=1, hidden_size=7),  # as Megatron-LM saves its arguments
        "checkpoint_version": 3.0,
        "iteration": 100,
        "rng_state": [{"torch_rng_state": torch.arange(8, dtype=torch.uint8)}],
        "optimizer": {"param_groups": [{"lr": 0.1}], "scale": torch.tensor([2.0, 4.0]).t()},
    }
    torch.save(common, folder / "common.pt")
    metadata = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch"}
    (folder / "metadata.json").write_text(json.dumps(metadata))
    return folder


def test_a_torch_dist_folder_is_one_model(torch_dist: Path, mount: MountFn) -> None:
    mnt = mount(str(torch_dist))
    assert sorted(os.listdir(mnt)) == ["common", "files", "header.json", "metadata", "tensors"]
    w = torch.arange(35, dtype=torch.float32).reshape(5, 7) / 3
    assert Path(tensor_path(mnt, "decoder.layers.0.mlp.weight")).read_bytes() == w.numpy().tobytes()
    rng = Path(mnt, "common", "rng_state", "0", "torch_rng_state")
    assert rng.read_bytes() == bytes(range(8))
    assert Path(mnt, "common", "optimizer", "scale").read_bytes() == torch.tensor([2.0, 4.0]).numpy().tobytes()
    assert Path(mnt, "metadata", "sharded_backend").read_text() == "torch_dist\n"
    assert Path(mnt, "metadata", "sharded_backend_version").read_text() == "1\n"
    header = json.loads(Path(mnt, "header.json").read_bytes())
    assert set(header) - {"__metadata__"} == {"decoder.layers.0.mlp.weight", "embedding.word_embeddings.weight"}
    assert sorted(os.listdir(Path(mnt, "files"))) == sorted(os.listdir(torch_dist))


def test_info_warns_of_the_runs_arguments_and_check_names_them(torch_dist: Path) -> None:
    info = stfs_command("info", "--json", str(torch_dist))
    assert info.returncode == 0, info.stderr
    assert len(json.loads(info.stdout)["models"]) == 1  # common.pt is the model's, not one of its own
    assert "argparse.Namespace" in info.stderr
    check = stfs_command("check", str(torch_dist))
    assert check.returncode == 1 and "argparse.Namespace" in check.stdout + check.stderr
