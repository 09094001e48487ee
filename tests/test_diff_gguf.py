"""``stfs diff`` and ``stfs check --values`` on GGUF models (SPEC §10, §11): quantized values compared as ``f32/``
decodes them (``gguf.quants.dequantize``), with each other and with safetensors models by name. Files written by
gguf-py's GGUFWriter and by the real safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from safetensors.numpy import save_file

from stfs.chunks import CHUNK_BYTES
from stfs.cli import main
from tests.test_gguf_format import random_blocks, write

Q8_0 = GGMLQuantizationType.Q8_0
Q4_K = GGMLQuantizationType.Q4_K


def diff_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["diff", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def entry(document: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in document["tensors"] if t["name"] == name)


def quantized(kind: GGMLQuantizationType, shape: tuple[int, int], seed: int) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return quants.quantize(values, kind)


def test_one_changed_quantized_value_in_the_last_chunk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Q8_0 tensor of three chunks whose bytes differ in one quant of its last block: one value differs, by the
    block's scale times the change, at its index; the Q4_K and F32 tensors are identical."""
    big = quantized(Q8_0, (64, 32768), seed=1)
    assert big.nbytes > 2 * CHUNK_BYTES
    tensors = {"blk.0.ffn_up.weight": (big, Q8_0), "blk.0.attn_q.weight": (random_blocks(Q4_K, 8, 2), Q4_K)}
    tensors["output_norm.weight"] = (np.linspace(-1, 1, 64, dtype=np.float32), None)
    a = write(tmp_path / "a.gguf", tensors)
    changed = big.copy()
    changed[-1, -3] ^= 0x11  # an int8 quant of the last block (its scale is the block's first two bytes)
    b = write(tmp_path / "b.gguf", {**tensors, "blk.0.ffn_up.weight": (changed, Q8_0)})

    code, document = diff_json(capsys, str(a), str(b))

    before = quants.dequantize(big, Q8_0).astype(np.float64)
    after = quants.dequantize(changed, Q8_0).astype(np.float64)
    gaps = np.abs(after - before)
    assert code == 1
    found = entry(document, "blk.0.ffn_up.weight")
    assert (found["status"], found["dtype"], found["shape"]) == ("different", ["Q8_0", "Q8_0"], [[64, 32768]] * 2)
    assert found["differ"] == 1 == np.count_nonzero(gaps)
    assert found["max_abs"] == gaps.max() > 0
    assert found["where"] == [int(i) for i in np.unravel_index(int(np.argmax(gaps)), gaps.shape)]
    assert found["rel_l2"] == pytest.approx(np.linalg.norm(after - before) / np.linalg.norm(before), rel=1e-9)
    assert document["summary"]["identical"] == 2 and document["summary"]["different"] == 1


def test_a_gguf_against_safetensors_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A quantized tensor against the F32 values it decodes to: another dtype, no value differs; against values one
    off in one place: that value; an F32 tensor in both formats: identical (the same bytes)."""
    weight = quantized(Q8_0, (16, 256), seed=3)
    decoded = quants.dequantize(weight, Q8_0)
    norm = np.linspace(0, 1, 16, dtype=np.float32)
    gguf_file = write(tmp_path / "m.gguf", {"w": (weight, Q8_0), "norm": (norm, None)})
    same = tmp_path / "same.safetensors"
    save_file({"w": decoded, "norm": norm}, str(same))
    off = decoded.copy()
    off[5, 200] += 0.5
    other = tmp_path / "other.safetensors"
    save_file({"w": off, "norm": norm}, str(other))

    code, document = diff_json(capsys, str(gguf_file), str(same))
    assert code == 1  # a dtype changed is a difference, as diff(1) sees one
    found = entry(document, "w")
    assert (found["status"], found["dtype"], found["differ"], found["max_abs"]) == (
        "changed_type",
        ["Q8_0", "F32"],
        0,
        None,  # no value differs: no largest difference
    )
    assert entry(document, "norm")["status"] == "identical"

    code, document = diff_json(capsys, str(gguf_file), str(other))
    found = entry(document, "w")
    assert (found["differ"], found["where"]) == (1, [5, 200])
    assert found["max_abs"] == abs(float(off[5, 200]) - float(decoded[5, 200]))


def test_a_type_the_package_cannot_decode_is_compared_by_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kind = GGMLQuantizationType.Q8_K
    _, type_size = GGML_QUANT_SIZES[kind]
    blocks = np.random.default_rng(4).integers(0, 256, size=(2, 2 * type_size), dtype=np.uint8)
    a = write(tmp_path / "a.gguf", {"k": (blocks, kind)})
    changed = blocks.copy()
    changed[1, 7] ^= 1
    b = write(tmp_path / "b.gguf", {"k": (changed, kind)})
    assert diff_json(capsys, str(a), str(a))[0] == 0
    code, document = diff_json(capsys, str(a), str(b))
    found = entry(document, "k")
    assert (code, found["status"], found["dtype"]) == (1, "different", ["Q8_K", "Q8_K"])
    assert "max_abs" not in found or found["max_abs"] is None


def test_check_values_finds_nan_and_infinities_in_quantized_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Q8_0 blocks whose f16 scale is NaN or +inf: every value of the first NaN; of the second, +inf or -inf by
    its quant's sign (NaN where the quant is 0), counted as ``gguf.quants.dequantize`` gives them."""
    weight = quantized(Q8_0, (4, 4096), seed=5)
    weight[1, 34 * 3 : 34 * 3 + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    weight[2, 34 * 7 : 34 * 7 + 2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    clean = quantized(GGMLQuantizationType.Q4_0, (4, 256), seed=6)
    path = write(tmp_path / "bad.gguf", {"w": (weight, Q8_0), "clean": (clean, GGMLQuantizationType.Q4_0)})

    code = main(["check", "--values", str(path)])
    lines = capsys.readouterr().out.splitlines()

    with np.errstate(all="ignore"):
        values = quants.dequantize(weight, Q8_0)
    nan, posinf, neginf = np.isnan(values).sum(), (values == np.inf).sum(), (values == -np.inf).sum()
    assert nan >= 32 and posinf > 0 and neginf > 0
    first = [int(i) for i in np.unravel_index(int(np.argmax(~np.isfinite(values))), values.shape)]
    assert first == [1, 96]
    assert code == 1
    assert f"{path}: tensor 'w': {nan} NaN, {posinf} +inf, {neginf} -inf, the first at {first}" in lines
    assert not any("'clean'" in line for line in lines)
