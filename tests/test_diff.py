"""``stfs diff A B`` (SPEC §10) on models written by the real safetensors (torch tensors for BF16 and F8): every
case of the contract, through ``main`` and through the command itself."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stfs.chunks import CHUNK_BYTES
from stfs.cli import main
from stfs.sources import LocalFiles, SourceChanged
from tests.helpers import stfs_command
from tests.models import write_header
from tests.torch_models import model, write, write_shards


def diff_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["diff", "--json", *args])
    out = capsys.readouterr().out
    return code, json.loads(out)


def diff_text(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    code = main(["diff", *args])
    return code, capsys.readouterr().out.splitlines()


def entry(document: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in document["tensors"] if t["name"] == name)


def test_a_single_file_and_a_sharded_set_of_the_same_tensors_are_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = model()
    single = write(tmp_path / "single" / "model.safetensors", tensors)
    index = write_shards(tmp_path / "sharded", tensors)
    code, lines = diff_text(capsys, single, index)
    assert code == 0
    assert lines == [
        f"{len(tensors)} tensors: {len(tensors)} identical, 0 close, 0 different, 0 only in A, "
        "0 only in B, 0 with another dtype or shape"
    ]
    code, document = diff_json(capsys, str(tmp_path / "sharded"), single)  # a folder holding the set, too
    assert code == 0
    assert document["summary"] == {
        "identical": len(tensors),
        "close": 0,
        "different": 0,
        "only_a": 0,
        "only_b": 0,
        "changed_type": 0,
        "tied": 0,
    }
    assert {t["status"] for t in document["tensors"]} == {"identical"}
    assert [t["name"] for t in document["tensors"]] == sorted(tensors)
    assert document["a"] == str(tmp_path / "sharded") and document["b"] == single


def test_one_changed_value_exact_max_and_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors = model()
    a = write(tmp_path / "a.safetensors", tensors)
    changed = dict(tensors)
    weight = tensors["model.embed.weight"].clone()
    weight[17, 5] += 0.25
    changed["model.embed.weight"] = weight
    b = write(tmp_path / "b.safetensors", changed)
    code, document = diff_json(capsys, a, b)
    assert code == 1
    found = entry(document, "model.embed.weight")
    before, after = tensors["model.embed.weight"].double(), weight.double()
    assert found["status"] == "different"
    assert found["differ"] == 1
    assert found["max_abs"] == abs(after[17, 5] - before[17, 5]).item()
    assert found["where"] == [17, 5]
    assert found["rel_l2"] == pytest.approx((after - before).norm().item() / before.norm().item(), rel=1e-12)
    assert found["dtype"] == ["F32", "F32"] and found["shape"] == [[64, 32], [64, 32]]
    assert document["summary"]["different"] == 1 and document["summary"]["identical"] == len(tensors) - 1
    code, lines = diff_text(capsys, a, b)
    assert code == 1
    assert lines[0] == (
        f"~ model.embed.weight  F32 [64, 32]: 1 of 2048 values differ, max |a-b| {found['max_abs']!r} at [17, 5], "
        f"|a-b|/|a| {found['rel_l2']:.3g}"
    )
    assert len(lines) == 2  # the one line, then the summary


def test_a_difference_after_many_equal_chunks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tensor of several chunks whose bytes differ only in its last one: the index counts every chunk before, and
    ‖a‖ covers the equal ones (read again for it)."""
    values = torch.randn(3 * CHUNK_BYTES // 2 + 5, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    changed = values.clone()
    last = len(values) - 2
    changed[last] = 100.0
    changed[10] = float("nan")  # a NaN against a number: differs, but is not in max |a-b|
    a = write(tmp_path / "a.safetensors", {"big": values})
    b = write(tmp_path / "b.safetensors", {"big": changed})
    code, document = diff_json(capsys, a, b)
    found = entry(document, "big")
    x, y = values.double(), changed.double()
    finite = torch.isfinite(x) & torch.isfinite(y)
    gaps = torch.where(finite, (x - y).abs(), 0.0)
    assert (code, found["differ"], found["where"]) == (1, 2, [last])
    assert found["max_abs"] == gaps.max().item()
    assert found["rel_l2"] == pytest.approx(gaps.norm().item() / torch.where(finite, x, 0.0).norm().item(), rel=1e-9)


def test_added_removed_retyped_and_reshaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors = model()
    changed = dict(tensors)
    del changed["model.norm.bias"]  # removed
    changed["model.extra"] = torch.ones(3)  # added
    changed["model.embed.weight"] = tensors["model.embed.weight"].to(torch.bfloat16)  # retyped F32 -> BF16
    changed["model.layers.0.mlp.up.weight"] = tensors["model.layers.0.mlp.up.weight"].reshape(32, 48)  # reshaped
    changed["model.positions"] = tensors["model.positions"].to(torch.int32)  # retyped, the same values
    a = write(tmp_path / "a.safetensors", tensors)
    b = write(tmp_path / "b.safetensors", changed)
    code, lines = diff_text(capsys, a, b)
    assert code == 1
    original = tensors["model.embed.weight"].double()
    error = (changed["model.embed.weight"].double() - original).abs()
    where = [int(i) for i in np.unravel_index(int(error.flatten().argmax()), (64, 32))]
    differ = int((error > 0).sum())
    rel_l2 = error.norm().item() / original.norm().item()
    assert lines == [
        f"! model.embed.weight  F32 [64, 32] -> BF16 [64, 32]: {differ} of 2048 values differ, "
        f"max |a-b| {error.max().item()!r} at {where}, |a-b|/|a| {rel_l2:.3g}",
        "+ model.extra  F32 [3]",
        "! model.layers.0.mlp.up.weight  F16 [48, 32] -> F16 [32, 48]",
        "- model.norm.bias  F64 [32]",
        "! model.positions  I64 [100] -> I32 [100]: 0 of 100 values differ, |a-b|/|a| 0",
        "10 tensors: 5 identical, 0 close, 0 different, 1 only in A, 1 only in B, 3 with another dtype or shape",
    ]
    code, document = diff_json(capsys, a, b)
    retyped = entry(document, "model.embed.weight")
    assert retyped["status"] == "changed_type" and retyped["dtype"] == ["F32", "BF16"]
    assert retyped["max_abs"] == error.max().item() and retyped["where"] == where
    reshaped = entry(document, "model.layers.0.mlp.up.weight")
    assert reshaped == {
        "name": "model.layers.0.mlp.up.weight",
        "status": "changed_type",
        "dtype": ["F16", "F16"],
        "shape": [[48, 32], [32, 48]],
    }
    assert entry(document, "model.norm.bias") == {
        "name": "model.norm.bias",
        "status": "only_a",
        "dtype": ["F64", None],
        "shape": [[32], None],
    }
    assert entry(document, "model.extra")["status"] == "only_b"
    assert entry(document, "model.extra")["dtype"] == [None, "F32"]
    assert document["summary"] == {
        "identical": 5,
        "close": 0,
        "different": 0,
        "only_a": 1,
        "only_b": 1,
        "changed_type": 3,
        "tied": 0,
    }


def test_tolerances_are_numpy_isclose(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_values = np.array([1.0, 100.0, 0.0, -5.0, 1e-9], dtype=np.float64)
    b_values = np.array([1.05, 101.0, 0.001, -5.0, 0.0], dtype=np.float64)
    a = write(tmp_path / "a.safetensors", {"t": torch.from_numpy(a_values)})
    b = write(tmp_path / "b.safetensors", {"t": torch.from_numpy(b_values)})
    for atol, rtol in [(0.0, 0.0), (0.06, 0.0), (0.0, 0.01), (0.001, 0.01), (1.0, 0.0), (0.0, 0.05)]:
        code, document = diff_json(capsys, "--atol", str(atol), "--rtol", str(rtol), a, b)
        expected = int((~np.isclose(a_values, b_values, rtol=rtol, atol=atol)).sum())
        found = entry(document, "t")
        assert found["differ"] == expected, (atol, rtol)
        assert found["status"] == ("close" if expected == 0 else "different")
        assert code == (0 if expected == 0 else 1)
        assert found["max_abs"] == 1.0 and found["where"] == [1]  # whatever the tolerance
    # rtol scales |b|, not |a|, as numpy.isclose does: 100 vs 101 is within 1/101 of b but not of a
    code, document = diff_json(capsys, "--rtol", str(1 / 100.5), a, b)
    assert entry(document, "t")["differ"] == int((~np.isclose(a_values, b_values, rtol=1 / 100.5, atol=0.0)).sum())


def test_nan_infinities_and_negative_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nan, inf = float("nan"), float("inf")
    a_values = [nan, inf, -inf, 0.0, 1.0, inf, nan, 2.0]
    b_values = [nan, inf, -inf, -0.0, 1.0, -inf, 3.0, 2.0]
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        a = write(tmp_path / "a.safetensors", {"t": torch.tensor(a_values, dtype=dtype)})
        b = write(tmp_path / "b.safetensors", {"t": torch.tensor(b_values, dtype=dtype)})
        code, document = diff_json(capsys, a, b)
        found = entry(document, "t")
        # equal: NaN/NaN, inf/inf, -inf/-inf, 0/-0, 1/1, 2/2; not: inf/-inf, NaN/3
        assert (code, found["status"], found["differ"]) == (1, "different", 2), dtype
        assert found["max_abs"] is None and found["where"] is None  # no element differing where both are finite
    only_signs = [0.0, -0.0, nan, inf]
    a = write(tmp_path / "a.safetensors", {"t": torch.tensor(only_signs)})
    b = write(tmp_path / "b.safetensors", {"t": torch.tensor([-0.0, 0.0, -nan, inf])})
    code, document = diff_json(capsys, a, b)
    found = entry(document, "t")
    assert (code, found["status"], found["differ"], found["max_abs"], found["rel_l2"]) == (0, "close", 0, None, 0.0)
    code, lines = diff_text(capsys, a, b)
    assert code == 0 and len(lines) == 1  # close is equal: no line


def test_nan_and_infinities_that_differ_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A NaN or an infinity against something else is counted by kind in the line and in --json: not a bare
    "1 of 32 values differ, |a-b|/|a| 0"."""
    nan, inf = float("nan"), float("inf")
    values = torch.randn(32, generator=torch.Generator().manual_seed(5))
    changed = values.clone()
    changed[9] = nan
    a = write(tmp_path / "a.safetensors", {"t": values})
    b = write(tmp_path / "b.safetensors", {"t": changed})
    code, lines = diff_text(capsys, b, a)
    assert (code, lines[0]) == (1, "~ t  F32 [32]: 1 of 32 values differ (1 NaN in A only), |a-b|/|a| 0")
    code, document = diff_json(capsys, b, a)
    assert entry(document, "t")["nonfinite"] == {
        "nan_only_a": 1,
        "nan_only_b": 0,
        "inf_only_a": 0,
        "inf_only_b": 0,
        "inf_opposite": 0,
    }
    # every kind: NaN / number, number / NaN, inf / number, number / -inf, +inf / -inf; the equal ones not counted
    a_values = [nan, inf, -inf, 0.0, 1.0, inf, nan, 2.0, 5.0, 4.0, -inf, nan, 8.0]
    b_values = [nan, inf, -inf, -0.0, 1.0, -inf, 3.0, 2.0, nan, -inf, 7.0, inf, 9.0]
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        a = write(tmp_path / "a.safetensors", {"t": torch.tensor(a_values, dtype=dtype)})
        b = write(tmp_path / "b.safetensors", {"t": torch.tensor(b_values, dtype=dtype)})
        for tolerance in ([], ["--atol", "100"]):  # the non-finite ones differ whatever the tolerance
            code, document = diff_json(capsys, *tolerance, a, b)
            found = entry(document, "t")
            counts = {"nan_only_a": 2, "nan_only_b": 1, "inf_only_a": 1, "inf_only_b": 1, "inf_opposite": 1}
            assert found["nonfinite"] == counts, (dtype, tolerance)
            assert (code, found["differ"]) == (1, 6 + (not tolerance)), (dtype, tolerance)
        code, lines = diff_text(capsys, a, b)
        assert lines[0].startswith(
            f"~ t  {document['tensors'][0]['dtype'][0]} [13]: 7 of 13 values differ (2 NaN in A only, 1 NaN in B only, "
            "1 inf in A only, 1 inf in B only, 1 +inf against -inf), max |a-b| 1.0 at [12]"
        ), lines[0]
    retyped = write(tmp_path / "r.safetensors", {"t": torch.tensor(b_values, dtype=torch.float16)})
    code, document = diff_json(capsys, a, retyped)  # values compared across dtypes: counted too
    assert entry(document, "t")["nonfinite"]["nan_only_a"] == 2


def test_c64_is_compared_by_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    values = torch.tensor([1 + 2j, 3 - 1j, 0j, 5j], dtype=torch.complex64)
    changed = values.clone()
    changed[1] = 3 + 1j
    changed[3] = complex(-0.0, 5.0)  # a different sign of zero: other bytes, so different (no values for C64)
    a = write(tmp_path / "a.safetensors", {"c": values})
    same = write(tmp_path / "same.safetensors", {"c": values.clone()})
    b = write(tmp_path / "b.safetensors", {"c": changed})
    assert diff_json(capsys, a, same)[1]["tensors"][0]["status"] == "identical"
    code, document = diff_json(capsys, a, b)
    assert code == 1
    assert document["tensors"][0] == {
        "name": "c",
        "status": "different",
        "dtype": ["C64", "C64"],
        "shape": [[4], [4]],
        "differ": 2,
        "max_abs": None,
        "where": None,
        "rel_l2": None,
    }
    assert diff_text(capsys, a, b)[1][0] == "~ c  C64 [4]: 2 of 4 values differ (compared by bytes)"
    retyped = write(tmp_path / "r.safetensors", {"c": values.real.contiguous()})
    code, lines = diff_text(capsys, a, retyped)
    assert (code, lines[0]) == (1, "! c  C64 [4] -> F32 [4]")  # no values to compare with


def test_integers_and_bool_as_their_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ints = torch.tensor([[1, 2], [3, -4]], dtype=torch.int16)
    flags = torch.tensor([True, False, True])
    a = write(tmp_path / "a.safetensors", {"i": ints, "f": flags})
    b = write(tmp_path / "b.safetensors", {"i": torch.tensor([[1, 2], [3, 6]], dtype=torch.int16), "f": ~flags})
    code, document = diff_json(capsys, a, b)
    assert code == 1
    assert {k: entry(document, "i")[k] for k in ("differ", "max_abs", "where")} == {
        "differ": 1,
        "max_abs": 10.0,
        "where": [1, 1],
    }
    assert {k: entry(document, "f")[k] for k in ("differ", "max_abs", "where")} == {
        "differ": 3,
        "max_abs": 1.0,
        "where": [0],
    }


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
)
def test_f8_values(tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: torch.dtype) -> None:
    values = torch.linspace(-4, 4, 64).to(dtype)
    changed = values.clone()
    changed[9] = torch.tensor(2.0).to(dtype)
    a = write(tmp_path / "a.safetensors", {"f8": values})
    b = write(tmp_path / "b.safetensors", {"f8": changed})
    code, document = diff_json(capsys, a, b)
    found = entry(document, "f8")
    assert (code, found["differ"], found["where"]) == (1, 1, [9])
    assert found["max_abs"] == abs(changed[9].double() - values[9].double()).item()


def test_a_folder_of_several_models_names_each_tensor_by_its_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for side in ("a", "b"):
        write(tmp_path / side / "unet" / "diffusion_pytorch_model.safetensors", {"w": torch.ones(2)})
        write(tmp_path / side / "vae" / "model.safetensors", {"w": torch.ones(2) * (2 if side == "a" else 3)})
    code, lines = diff_text(capsys, str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 1
    assert lines[0] == "~ vae/model/w  F32 [2]: 2 of 2 values differ, max |a-b| 1.0 at [0], |a-b|/|a| 0.5"


def test_odd_names_print_on_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write(tmp_path / "a.safetensors", {"line\nbreak": torch.ones(1)})
    b = write(tmp_path / "b.safetensors", {"x": torch.ones(1)})
    code, lines = diff_text(capsys, a, b)
    assert lines[:2] == ["- line\\nbreak  F32 [1]", "+ x  F32 [1]"]
    code, document = diff_json(capsys, a, b)
    assert document["tensors"][0]["name"] == "line\nbreak"


def test_trouble_is_exit_2_in_one_line(tmp_path: Path) -> None:
    good = write(tmp_path / "good.safetensors", {"w": torch.ones(2)})
    broken = write_header(
        str(tmp_path / "broken.safetensors"), {"w": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4
    )
    index = tmp_path / "set" / "model.safetensors.index.json"
    index.parent.mkdir()
    index.write_text(json.dumps({"weight_map": {"w": "missing.safetensors"}}))
    cases = [
        ([good, str(tmp_path / "nowhere.safetensors")], "no such file or directory"),
        ([broken, good], "rule 7"),
        ([good, str(index)], "missing"),
        ([good, "ftp://host/x.safetensors"], "not a source stfs reads"),
    ]
    for argv, message in cases:
        result = stfs_command("diff", *argv)
        assert (result.returncode, result.stdout) == (2, ""), (argv, result.stderr)
        assert "Traceback" not in result.stderr and message in result.stderr, (argv, result.stderr)
        assert len(result.stderr.splitlines()) == 1, result.stderr
    usage = [([good, good, "--atol", "-1"], "tolerance"), ([good, good, "--rtol", "x"], "not a number"), ([good], "")]
    for argv, message in usage:
        result = stfs_command("diff", *argv)
        assert (result.returncode, result.stdout) == (2, ""), (argv, result.stderr)
        assert "Traceback" not in result.stderr and message in result.stderr, (argv, result.stderr)
        assert len(result.stderr.splitlines()) == 1, result.stderr


def test_a_truncated_source_is_trouble(tmp_path: Path) -> None:
    a = write(tmp_path / "a.safetensors", {"w": torch.ones(8)})
    path = tmp_path / "b.safetensors"
    write(path, {"w": torch.ones(8)})
    with open(path, "r+b") as stream:  # the header as it was, the data cut short
        stream.truncate(os.path.getsize(path) - 4)
    result = stfs_command("diff", a, str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_a_source_changed_while_it_is_read_is_trouble(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = write(tmp_path / "a.safetensors", model())
    b = write(tmp_path / "b.safetensors", model(seed=1))
    reads = []

    def changed_after_two_reads(self: LocalFiles, key: str, *args: object) -> int:
        reads.append(key)
        if len(reads) > 2:
            raise SourceChanged(f"{key} has changed since it was mounted")
        return original(self, key, *args)  # type: ignore[arg-type]

    original = LocalFiles.read_into
    monkeypatch.setattr(LocalFiles, "read_into", changed_after_two_reads)
    assert main(["diff", a, b]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"stfs: {reads[-1]}: cannot read: {reads[-1]} has changed since it was mounted"
    ]


def test_exit_status_as_diff_and_cmp(tmp_path: Path) -> None:
    a = write(tmp_path / "a.safetensors", model())
    b = write(tmp_path / "b.safetensors", model(seed=1))
    same = stfs_command("diff", a, a)
    assert (same.returncode, same.stderr) == (0, "")  # not a terminal: no progress bar
    different = stfs_command("diff", "--quiet", a, b)
    assert different.returncode == 1 and different.stderr == ""
    assert different.stdout.splitlines()[-1].startswith("9 tensors: ")


def test_rel_l2_and_max_match_a_torch_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A fine-tune: every value moved a little. The figures are those of the script a user writes today."""
    tensors = model()
    generator = torch.Generator().manual_seed(9)
    tuned = {
        name: (t.double() + 1e-3 * torch.randn(t.shape, generator=generator, dtype=torch.float64)).to(t.dtype)
        if t.is_floating_point() and t.numel()
        else t
        for name, t in tensors.items()
    }
    a = write(tmp_path / "a.safetensors", tensors)
    b = write(tmp_path / "b.safetensors", tuned)
    code, document = diff_json(capsys, a, b)
    assert code == 1
    for name, t in tensors.items():
        found = entry(document, name)
        x, y = t.double(), tuned[name].double()
        if torch.equal(x, y):
            assert found["status"] == "identical", name
            continue
        gaps = (x - y).abs()
        assert found["differ"] == int((gaps > 0).sum()), name
        assert found["max_abs"] == gaps.max().item(), name
        assert found["where"] == [int(i) for i in np.unravel_index(int(gaps.flatten().argmax()), t.shape)], name
        assert math.isclose(found["rel_l2"], (gaps.norm() / x.norm()).item(), rel_tol=1e-9), name
