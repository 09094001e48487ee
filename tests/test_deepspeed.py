"""DeepSpeed ZeRO checkpoints (SPEC §16), written by DeepSpeed itself during the test run: three tiny training runs
on CPU over gloo (tests/deepspeed_train.py, one process per rank with torch.distributed's environment), ZeRO-3 bf16
on 2 ranks, ZeRO-2 fp32 on 3, ZeRO-1 bf16 on 3 (DeepSpeed's BF16 optimizer), each saving global_step1/ and
global_step2/; the model has odd sizes, a frozen layer, a float and an int64 buffer and a tied head. Every tensor is
read through a real mount and compared byte for byte with what DeepSpeed's own ``get_fp32_state_dict_from_zero_
checkpoint`` gives, and the Adam moments in optimizer/ with what its ``ds_to_universal`` writes
(tests/deepspeed_reference.py, in a process of its own); metadata/, --view safetensors (loaded by safetensors'
load_file), info, check, check --values, diff of the two steps; each refusal one line naming its rule, the broken
checkpoint made by copying DeepSpeed's files or re-saving them with DeepSpeed's own classes."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import IN_CI, MountFn, refusal, stfs_command, tensor_path

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).parent
RUNS = {  # name: (ZeRO stage, dtype, ranks)
    "zero3-bf16-2": (3, "bf16", 2),
    "zero2-fp32-3": (2, "fp32", 3),
    "zero1-bf16-3": (1, "bf16", 3),
}


def _need_deepspeed() -> None:
    """Skip where deepspeed is not installed, saying so; in CI (which installs the test extra) fail instead."""
    if importlib.util.find_spec("deepspeed") is None:
        message = "deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed): no ZeRO checkpoint to read"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _ranks(stage: int, dtype: str, ranks: int, out: Path, log: Path) -> list[subprocess.Popen[bytes]]:
    """The processes of one run: each rank with torch.distributed's environment (DeepSpeed's launcher is not
    needed, and wants a GPU count)."""
    port = _free_port()
    processes = []
    for rank in range(ranks):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(ranks),
            LOCAL_WORLD_SIZE=str(ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            DS_ACCELERATOR="cpu",
            OMP_NUM_THREADS="1",
        )
        command = [sys.executable, str(HERE / "deepspeed_train.py"), str(stage), dtype, str(out)]
        with open(log.with_suffix(f".{rank}.log"), "wb") as stream:
            processes.append(subprocess.Popen(command, env=env, stdout=stream, stderr=subprocess.STDOUT))
    return processes


@pytest.fixture(scope="session")
def zero_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three runs (each folder: latest, global_step1/, global_step2/), trained at once, and beside each run
    ``NAME.ref/`` with DeepSpeed's own consolidation of its latest step."""
    _need_deepspeed()
    root = tmp_path_factory.mktemp("zero")
    started = {name: _ranks(*spec, root / name, root / name) for name, spec in RUNS.items()}
    for name, processes in started.items():
        codes = [process.wait(timeout=240) for process in processes]
        if any(codes):
            logs = "".join(path.read_text()[-2000:] for path in sorted(root.glob(f"{name}.*.log")))
            pytest.fail(f"DeepSpeed run {name} failed: {codes}\n{logs}")
    pairs = [str(part) for name in RUNS for part in (root / name, root / f"{name}.ref")]
    reference = subprocess.run(
        [sys.executable, str(HERE / "deepspeed_reference.py"), "fp32", *pairs],
        env=dict(os.environ, DS_ACCELERATOR="cpu"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    return {name: root / name for name in RUNS}


def reference(run: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(run.with_name(run.name + ".ref") / "fp32.pt")
    return state


def raw(tensor: Any) -> bytes:
    return bytes(tensor.contiguous().view(-1).view(torch.uint8).numpy()) if tensor.numel() else b""


@pytest.fixture(params=list(RUNS))
def zero_run(request: pytest.FixtureRequest, zero_runs: dict[str, Path]) -> Path:
    return zero_runs[str(request.param)]


def test_every_tensor_is_zero_to_fp32s_bytes(zero_run: Path, mount: MountFn) -> None:
    """The run folder (whose latest names global_step2) mounts as the consolidated model: each tensor byte for
    byte as DeepSpeed's consolidation, in its dtype and shape (float32 masters, frozen and buffers as saved)."""
    expected = reference(zero_run)
    mnt = mount(str(zero_run))
    header = json.loads(Path(mnt, "header.json").read_bytes())
    header.pop("__metadata__")
    assert list(header) == list(expected)
    joined = 0
    for name, tensor in expected.items():
        path = tensor_path(mnt, name)
        assert Path(path).read_bytes() == raw(tensor), name
        assert header[name]["shape"] == list(tensor.shape)
        assert json.loads(os.getxattr(path, "user.deepspeed.shape")) == list(tensor.shape)
        joined += int(os.getxattr(path, "user.deepspeed.runs")) > 1
    assert Path(tensor_path(mnt, "head.weight")).read_bytes() == Path(tensor_path(mnt, "embed.weight")).read_bytes()
    assert joined, "some parameter lies across two ranks' partitions and is gathered"
    assert expected["position_ids"].dtype == torch.int64 and expected["mid.weight"].dtype == torch.float32


def test_optimizer_states_are_ds_to_universals(zero_run: Path, mount: MountFn) -> None:
    """optimizer/STATE/NAME: each trained parameter's Adam moments, the bytes ds_to_universal writes to
    zero/NAME/STATE.pt, shaped as the parameter."""
    universal = zero_run.with_name(zero_run.name + ".ref") / "universal" / "zero"
    mnt = mount(str(zero_run))
    expected = reference(zero_run)
    for state in ("exp_avg", "exp_avg_sq"):
        saved = sorted(path.parent.name for path in universal.glob(f"*/{state}.pt"))
        served = sorted(
            str(path.relative_to(Path(mnt, "optimizer", state))).replace("/", ".")
            for path in Path(mnt, "optimizer", state).rglob("*")
            if path.is_file()
        )
        assert saved and served == saved
        for name in saved:
            tensor = torch.load(universal / name / f"{state}.pt")
            tensor = tensor["param"] if isinstance(tensor, dict) else tensor  # ZeRO-1/2: {"param": ..., "cat_dim": 0}
            path = os.path.join(mnt, "optimizer", state, *name.split("."))
            assert Path(path).read_bytes() == raw(tensor), (state, name)
            assert json.loads(os.getxattr(path, "user.deepspeed.shape")) == list(expected[name].shape)


def test_the_tag_folder_and_a_rank_file_are_the_same_model(zero_run: Path) -> None:
    whole = stfs_command("info", "--json", str(zero_run))
    assert whole.returncode == 0, whole.stderr
    expected = json.loads(whole.stdout)["models"][0]["tensors"]
    for source in (zero_run / "global_step2", next((zero_run / "global_step2").glob("*model_states.pt"))):
        result = stfs_command("info", "--json", str(source))
        assert result.returncode == 0, result.stderr
        found = json.loads(result.stdout)["models"][0]["tensors"]
        assert [(t["name"], t["shape"], t["dtype"]) for t in found] == [
            (t["name"], t["shape"], t["dtype"]) for t in expected
        ]


def test_metadata_says_what_the_run_was(zero_runs: dict[str, Path], mount: MountFn) -> None:
    for name, (stage, dtype, ranks) in RUNS.items():
        run = zero_runs[name]
        mnt = Path(mount(str(run)))
        read = {file.name: file.read_text() for file in (mnt / "metadata").iterdir()}
        assert read["zero_stage"] == f"{stage}\n" and read["world_size"] == f"{ranks}\n"
        assert read["global_steps"] == "2\n" and read["tag"] == "global_step2\n"
        assert read["ds_version"] == (run.with_name(name + ".ref") / "version").read_text() + "\n"
        config = json.loads(read["ds_config"])
        assert config["zero_optimization"]["stage"] == stage and ("bf16" in config) == (dtype == "bf16")
        files = sorted(str(path.relative_to(mnt / "files")) for path in (mnt / "files").rglob("*") if path.is_file())
        assert files == sorted(str(path.relative_to(run)) for path in run.rglob("*") if path.is_file())


def test_the_safetensors_view_loads_as_the_trained_model(zero_runs: dict[str, Path], mount: MountFn) -> None:
    from safetensors.torch import load_file

    run = zero_runs["zero3-bf16-2"]
    expected = reference(run)
    mnt = mount(str(run), options=["view=safetensors"])
    loaded = load_file(os.path.join(mnt, "safetensors", "model.safetensors"))
    assert list(loaded) == list(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_a_remote_run_mounts_by_the_url_of_its_latest(zero_runs: dict[str, Path], nginx: Any, mount: MountFn) -> None:
    """Over HTTP (nginx on 127.0.0.1, which cannot list a folder) the rank files are found by their names."""
    run = zero_runs["zero3-bf16-2"]
    for path in run.rglob("*"):
        if path.is_file():
            nginx.put(f"run/{path.relative_to(run)}", path.read_bytes())
    mnt = mount(f"{nginx.url}/run/latest")
    for name, tensor in reference(run).items():
        assert Path(tensor_path(mnt, name)).read_bytes() == raw(tensor), name


def test_info_check_and_values_pass_without_warnings(zero_run: Path) -> None:
    info = stfs_command("info", str(zero_run))
    assert info.returncode == 0 and "global" not in info.stderr, info.stderr
    check = stfs_command("check", str(zero_run))
    assert check.returncode == 0 and "ok" in check.stdout, check.stdout + check.stderr
    values = stfs_command("check", "--values", str(zero_run))
    assert values.returncode == 0, values.stdout + values.stderr


def test_diff_of_two_steps_names_what_training_changed(zero_runs: dict[str, Path]) -> None:
    run = zero_runs["zero2-fp32-3"]
    result = stfs_command("diff", "--json", str(run / "global_step1"), str(run / "global_step2"))
    assert result.returncode == 1, result.stderr
    found = {tensor["name"]: tensor["status"] for tensor in json.loads(result.stdout)["tensors"]}
    assert found["mid.weight"] == "different" and found["embed.weight"] == "different"
    assert {found[name] for name in ("scale", "position_ids", "frozen.weight", "frozen.bias")} == {"identical"}


def _copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run / "global_step2", copy)
    return copy


def _mutate(what: str, file: Path, value: str = "") -> None:
    script = [sys.executable, str(HERE / "deepspeed_reference.py"), what, str(file), *([value] if value else [])]
    done = subprocess.run(script, env=dict(os.environ, DS_ACCELERATOR="cpu"), capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize(
    ("run_name", "case", "rule"),
    [
        ("zero2-fp32-3", "missing rank", "MissingRankFile"),
        ("zero3-bf16-2", "missing rank model", "MissingRankFile"),
        ("zero2-fp32-3", "extra rank", "RanksDisagree"),
        ("zero2-fp32-3", "stage", "RanksDisagree"),
        ("zero3-bf16-2", "short", "PartitionTooShort"),
        ("zero2-fp32-3", "short", "PartitionTooShort"),
        ("zero2-fp32-3", "tensor parallel", "ModelParallelCheckpoint"),
        ("zero1-bf16-3", "pipeline parallel", "ModelParallelCheckpoint"),
        ("zero2-fp32-3", "groups", "RanksDisagree"),
        ("zero3-bf16-2", "groups", "RanksDisagree"),
    ],
)
def test_a_broken_checkpoint_is_refused_in_one_line(
    zero_runs: dict[str, Path], tmp_path: Path, run_name: str, case: str, rule: str, require_fuse: None
) -> None:
    folder = _copy(zero_runs[run_name], tmp_path)
    optim = sorted(folder.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt"))[0]
    if case == "missing rank":
        optim.unlink()
    elif case == "missing rank model":
        (folder / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    elif case == "extra rank":
        shutil.copy(optim, folder / optim.name.replace("rank_1_", "rank_3_"))
    elif case == "stage":
        _mutate("stage", optim, "1")
    elif case == "short":
        _mutate("shorten", optim)
    elif case == "groups":  # rank 1 holds two parameter groups, rank 0's param_shapes one
        _mutate("groups", optim)
    elif case == "pipeline parallel":  # a PipelineModule's layers, each saved as layer_NN-model_MM-model_states.pt
        shutil.copy(folder / "mp_rank_00_model_states.pt", folder / "layer_00-model_00-model_states.pt")
    else:
        shutil.copy(folder / "mp_rank_00_model_states.pt", folder / "mp_rank_01_model_states.pt")
    result = refusal(folder, tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert rule in lines[0] and str(folder) in lines[0] and "Traceback" not in result.stderr
    if case in ("tensor parallel", "pipeline parallel"):
        assert "merge" in lines[0]
    if case == "pipeline parallel":
        assert "layer_*-model_states.pt" in lines[0]
    if case == "groups":
        assert f"{optim.name} holds 2 parameter groups, param_shapes 1" in lines[0]


def test_from_pretrained_loads_a_run_through_the_safetensors_view(tmp_path: Path, mount: MountFn) -> None:
    """A tiny GPT-2's weights saved by DeepSpeed (tests/deepspeed_write.py, one rank, ZeRO-2) beside its config.json,
    as the Hugging Face Trainer leaves a checkpoint: transformers' from_pretrained loads the mount's
    safetensors/ with no conversion, and every weight is the one saved."""
    import numpy as np

    _need_deepspeed()
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=31, n_positions=16, n_embd=12, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    arrays = {name: tensor.detach().numpy().copy() for name, tensor in model.state_dict().items()}
    np.savez(tmp_path / "arrays.npz", **arrays)
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(_free_port())
    run = tmp_path / "run"
    script = [sys.executable, str(HERE / "deepspeed_write.py"), str(tmp_path / "arrays.npz"), str(run)]
    done = subprocess.run(script, env=env, capture_output=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    config.save_pretrained(run / "contract")
    mnt = mount(str(run / "contract"), options=["view=safetensors"])
    loaded = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(mnt, "safetensors"), use_safetensors=True)
    for name, tensor in loaded.state_dict().items():
        assert np.array_equal(tensor.detach().numpy(), arrays[name]), name
