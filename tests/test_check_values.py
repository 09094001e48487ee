"""``stfs check --values`` (SPEC §10): a line for each tensor holding NaN or infinities, exit 1 when any does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stfs.chunks import CHUNK_BYTES
from stfs.cli import main
from tests.helpers import stfs_command
from tests.torch_models import model, write, write_shards

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e5m2]


def check(capsys: pytest.CaptureFixture[str], *sources: str) -> tuple[int, list[str]]:
    code = main(["check", "--values", *sources])
    return code, capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_and_infinities_are_counted_with_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: torch.dtype
) -> None:
    values = torch.zeros(6, 7, dtype=torch.float32)
    values[4, 1] = float("nan")
    values[2, 3] = float("-inf")  # the first in C order
    values[5, 6] = float("inf")
    values[3, 0] = float("-inf")
    path = write(tmp_path / "m.safetensors", {"clean": torch.ones(3), "bad": values.to(dtype)})
    code, lines = check(capsys, path)
    assert code == 1
    assert lines == [
        f"{path}: tensor 'bad': 1 NaN, 1 +inf, 2 -inf, the first at [2, 3]",
        f"{path}: 1 of 2 tensors hold NaN or infinities",
    ]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz])
def test_f8_kinds_without_infinities(tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: torch.dtype) -> None:
    values = torch.ones(10).to(dtype)
    values[7] = float("nan")
    path = write(tmp_path / "m.safetensors", {"f8": values})
    code, lines = check(capsys, path)
    assert (code, lines[0]) == (1, f"{path}: tensor 'f8': 1 NaN, 0 +inf, 0 -inf, the first at [7]")


def test_a_clean_model_passes_and_says_its_values_were_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path / "m.safetensors", model())
    code, lines = check(capsys, path)
    assert (code, lines) == (0, [f"{path}: ok (9 tensors, values checked)"])
    assert main(["check", path]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{path}: ok (9 tensors)"]  # without --values: as before


def test_a_special_deep_in_a_big_tensor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    values = torch.zeros(3 * CHUNK_BYTES // 2 + 11, dtype=torch.bfloat16)
    values[-3] = float("inf")
    path = write(tmp_path / "m.safetensors", {"big": values})
    code, lines = check(capsys, path)
    assert (code, lines[0]) == (1, f"{path}: tensor 'big': 0 NaN, 1 +inf, 0 -inf, the first at [{len(values) - 3}]")


def test_sharded_sets_name_the_shard_and_several_sources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors = model()
    tensors["model.embed.weight"] = tensors["model.embed.weight"].clone()
    tensors["model.embed.weight"][0, 1] = float("nan")
    index = write_shards(tmp_path / "set", tensors)
    shard = json.loads(Path(index).read_text())["weight_map"]["model.embed.weight"]
    clean = write(tmp_path / "clean.safetensors", model())
    code, lines = check(capsys, clean, index)
    assert code == 1
    assert lines == [
        f"{clean}: ok (9 tensors, values checked)",
        f"{tmp_path / 'set' / shard}: tensor 'model.embed.weight': 1 NaN, 0 +inf, 0 -inf, the first at [0, 1]",
        f"{index}: 1 of 9 tensors hold NaN or infinities",
    ]


def test_the_command_prints_no_progress_off_a_terminal(tmp_path: Path) -> None:
    values = torch.ones(4)
    values[2] = float("nan")
    path = write(tmp_path / "m.safetensors", {"w": values})
    result = stfs_command("check", "--values", path)
    assert (result.returncode, result.stderr) == (1, "")
    assert result.stdout.splitlines()[0] == f"{path}: tensor 'w': 1 NaN, 0 +inf, 0 -inf, the first at [2]"
