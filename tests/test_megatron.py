"""Megatron-Core / NeMo ``torch_dist`` checkpoints (SPEC §16), mounted as one model through a real mount: one written
by Megatron-Core's own ``dist_checkpointing.save`` from two tensor-parallel ranks on gloo (tests/megatron_write.py),
and one made of its parts (``torch.distributed.checkpoint.save``, ``common.pt`` by ``torch.save`` and
``metadata.json`` as Megatron-Core writes them) where a Megatron-LM run's arguments can be put in ``common.pt``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.helpers import IN_CI, MountFn, stfs_command, tensor_path

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


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint Megatron-Core writes from two ranks (skipped where megatron-core is not installed; failed in CI,
    which installs the test extra)."""
    if importlib.util.find_spec("megatron.core") is None:
        message = "megatron-core is not installed (pip install megatron-core): no torch_dist checkpoint to read"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    out = tmp_path_factory.mktemp("megatron") / "iter_0000100"
    out.mkdir()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
        env.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        command = [sys.executable, str(Path(__file__).with_name("megatron_write.py")), str(out)]
        ranks.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [rank.communicate(timeout=180)[0] for rank in ranks]
    if any(rank.returncode for rank in ranks):
        pytest.fail("Megatron-Core's writer failed:\n" + "".join(o.decode(errors="replace")[-2000:] for o in outputs))
    return out


def test_a_run_megatron_core_wrote_is_its_full_tensors(megatron_run: Path, mount: MountFn) -> None:
    from tests.megatron_write import expected

    mnt = mount(str(megatron_run))
    for name, tensor in expected().items():  # each rank's rows or columns, gathered
        assert Path(tensor_path(mnt, name)).read_bytes() == tensor.view(torch.uint8).numpy().tobytes(), name
    assert Path(mnt, "common", "loss_scale").read_bytes() == torch.tensor([2.0, 4.0]).numpy().tobytes()
    assert Path(mnt, "metadata", "sharded_backend").read_text() == "torch_dist\n"
    assert sorted(n for n in os.listdir(Path(mnt, "metadata")) if n.startswith("rng_state")) == [
        "rng_state%2Fshard_0_2",
        "rng_state%2Fshard_1_2",
    ]


def test_megatron_cores_own_plans_pass_check_without_warnings(megatron_run: Path) -> None:
    # Megatron-Core adds every rank's SavePlan to .metadata (torch's planner dataclasses): torch's own, no warning
    check = stfs_command("check", "--values", str(megatron_run))
    assert check.returncode == 0 and "warning" not in check.stderr, check.stdout + check.stderr
    assert "3 tensors, values checked" in check.stdout
