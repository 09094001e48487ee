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


def tiny_tied_llama(tmp_path: Path) -> tuple[Any, Path, Path]:
    """A tiny Llama whose lm_head is tied to its embeddings: (the model; its pytorch_model.bin as transformers wrote
    one, ``torch.save`` of the state dict, both names on one storage; the model.safetensors ``save_pretrained``
    writes, which leaves the tied lm_head.weight out)."""
    pytest.importorskip("transformers")
    from tests.test_pytorch_transformers import tiny_llama

    model: Any = tiny_llama(tied=True)
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    binary = tmp_path / "bin" / "pytorch_model.bin"
    binary.parent.mkdir()
    torch.save(state, binary)
    model.save_pretrained(tmp_path / "safetensors")
    return model, binary, tmp_path / "safetensors" / "model.safetensors"


def test_a_tensor_tied_in_one_side_is_not_a_difference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """lm_head.weight, one storage with model.embed_tokens.weight in the .bin, left out of the safetensors
    save_pretrained writes: tied, not "only in A", exit 0; either way round."""
    model, binary, safetensors = tiny_tied_llama(tmp_path)
    count = len(model.state_dict())
    code = main(["diff", str(binary), str(safetensors)])
    lines = capsys.readouterr().out.splitlines()
    assert (code, lines) == (
        0,
        [
            "= lm_head.weight  F32 [97, 32]: tied in A to model.embed_tokens.weight (one storage), which B has",
            f"{count} tensors: {count - 1} identical, 0 close, 0 different, 0 only in A, 0 only in B, "
            "0 with another dtype or shape, 1 tied",
        ],
    )
    code, document = diff_json(capsys, str(binary), str(safetensors))
    assert code == 0
    assert entry(document, "lm_head.weight") == {
        "name": "lm_head.weight",
        "status": "tied",
        "dtype": ["F32", None],
        "shape": [[97, 32], None],
        "tied_to": "model.embed_tokens.weight",
    }
    assert document["summary"]["tied"] == 1 and document["summary"]["only_a"] == 0
    code = main(["diff", str(safetensors), str(binary)])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert (
        lines[0] == "= lm_head.weight  F32 [97, 32]: tied in B to model.embed_tokens.weight (one storage), which A has"
    )


def test_an_equal_copy_or_a_tie_to_a_changed_tensor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only one storage makes a tie: an lm_head.weight of the same values in its own storage is only in A. A tie to
    a tensor whose values differ is still a tie; that tensor's line is the difference."""
    model, binary, safetensors = tiny_tied_llama(tmp_path)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}  # two storages
    copied = tmp_path / "copied.bin"
    torch.save(state, copied)
    code, document = diff_json(capsys, str(copied), str(safetensors))
    assert code == 1 and entry(document, "lm_head.weight")["status"] == "only_a"
    state = model.state_dict()
    with torch.no_grad():
        model.model.embed_tokens.weight[3, 4] += 1.0  # lm_head.weight with it: one storage
    changed = tmp_path / "changed.bin"
    torch.save(state, changed)
    code, document = diff_json(capsys, str(changed), str(safetensors))
    assert code == 1
    assert entry(document, "lm_head.weight")["status"] == "tied"
    assert entry(document, "model.embed_tokens.weight")["status"] == "different"
    assert entry(document, "model.embed_tokens.weight")["where"] == [3, 4]
