"""``stfs diff`` and ``stfs check --values`` on PyTorch checkpoints (SPEC §10, §12): written by the real
``torch.save``, strided tensors (a transpose, a slice with a step) compared in C order, against safetensors files
of the same tensors written by the real safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stfs.chunks import CHUNK_BYTES
from stfs.cli import main

torch = pytest.importorskip("torch")
save_file = pytest.importorskip("safetensors.torch").save_file


def diff_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["diff", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def entry(document: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in document["tensors"] if t["name"] == name)


def tensors() -> dict[str, Any]:
    torch.manual_seed(4)
    base = torch.randn(600, 700)  # 1.6 MiB: a transpose of it spans more than one chunk
    assert base.numel() * 4 > CHUNK_BYTES
    return {
        "plain": torch.randn(32, 16),
        "transposed": base.t(),
        "every_other": torch.randn(40, 30)[:, ::2],
        "half": torch.randn(8, 8).to(torch.float16).t(),
    }


def test_a_checkpoint_with_strided_tensors_equals_safetensors_of_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tensors()
    assert not state["transposed"].is_contiguous() and not state["every_other"].is_contiguous()
    torch.save(state, tmp_path / "model.bin")
    save_file({name: t.contiguous() for name, t in state.items()}, str(tmp_path / "model.safetensors"))

    code, document = diff_json(capsys, str(tmp_path / "model.bin"), str(tmp_path / "model.safetensors"))

    assert code == 0, document
    assert document["summary"]["identical"] == len(state)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_changed_value_of_a_transpose_is_found_at_its_c_order_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], legacy: bool
) -> None:
    state = tensors()
    torch.save(state, tmp_path / "a.bin", _use_new_zipfile_serialization=not legacy)
    changed = dict(state)
    weight = state["transposed"].clone()  # clone keeps the strides: still a transpose in the file
    weight[650, 3] += 2.0
    changed["transposed"] = weight
    torch.save(changed, tmp_path / "b.bin", _use_new_zipfile_serialization=not legacy)

    code, document = diff_json(capsys, str(tmp_path / "a.bin"), str(tmp_path / "b.bin"))

    found = entry(document, "transposed")
    before, after = state["transposed"].double(), weight.double()
    assert (code, found["status"], found["differ"], found["where"]) == (1, "different", 1, [650, 3])
    assert found["max_abs"] == (after - before).abs().max().item()
    assert found["rel_l2"] == pytest.approx((after - before).norm().item() / before.norm().item(), rel=1e-9)
    assert document["summary"]["identical"] == len(state) - 1


def test_check_values_names_the_c_order_index_in_a_strided_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tensors()
    state["transposed"][650, 3] = float("nan")
    state["transposed"][699, 599] = float("-inf")
    path = tmp_path / "bad.bin"
    torch.save(state, path)

    code = main(["check", "--values", str(path)])

    lines = capsys.readouterr().out.splitlines()
    assert code == 1
    assert f"{path}: tensor 'transposed': 1 NaN, 0 +inf, 1 -inf, the first at [650, 3]" in lines
