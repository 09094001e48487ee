"""``--view safetensors`` loaded by transformers' ``from_pretrained`` (SPEC §12): a tiny Llama whose weights are
only a ``torch.save``d state_dict, mounted, loaded through safetensors from ``MNT/safetensors``, gives the logits
the original model gives. No pickle is unpickled by the load: the repository it reads holds none."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import MountFn

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)


def tiny_llama(tied: bool) -> object:
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(7)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_from_pretrained_loads_a_bin_only_llama_through_safetensors(
    mount: MountFn, tmp_path: Path, tied: bool, legacy: bool
) -> None:
    model = tiny_llama(tied)
    repo = tmp_path / "llama"
    model.config.save_pretrained(repo)  # type: ignore[attr-defined]
    torch.save(
        model.state_dict(),  # type: ignore[attr-defined]
        repo / "pytorch_model.bin",
        _use_new_zipfile_serialization=not legacy,
    )
    assert sorted(os.listdir(repo)) == ["config.json", "pytorch_model.bin"]

    mnt = mount(str(repo), options=["view=safetensors"])
    served = Path(mnt, "safetensors")
    assert sorted(os.listdir(served)) == ["config.json", "model.safetensors"]
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(served), use_safetensors=True).eval()

    tokens = torch.tensor([[1, 5, 9, 42, 96, 3, 17, 64]])
    with torch.no_grad():
        expected = model(tokens).logits  # type: ignore[operator]
        got = loaded(tokens).logits
    assert torch.equal(got, expected)
    for name, tensor in model.state_dict().items():  # type: ignore[attr-defined]
        assert torch.equal(loaded.state_dict()[name], tensor), name
