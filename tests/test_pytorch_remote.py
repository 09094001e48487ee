"""Remote PyTorch checkpoints (SPEC §12): the zip's central directory and the pickle (the older layout: the pickles
at the start) read by Range, never the data; a ``.bin``-only repository on the tests' Hub mounted and served as
safetensors. nginx's access log tells what went over the wire."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import MountFn, run
from tests.servers import FakeHub, FaultProxy, Nginx

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(180)

MIB = 1 << 20


def checkpoint(path: Path, megabytes: int, legacy: bool = False) -> dict[str, object]:
    """A state_dict of ``megabytes`` MiB of float32 weights in 48 tensors, saved by torch at ``path``."""
    torch.manual_seed(1)
    per = megabytes * MIB // 4 // 48
    tensors: dict[str, object] = {f"model.layers.{i}.weight": torch.randn(per // 256, 256) for i in range(48)}
    tensors["model.norm.weight"] = torch.ones(256)
    torch.save(tensors, path, _use_new_zipfile_serialization=not legacy)
    return tensors


def data_ranges(path: Path, tensors: dict[str, object]) -> list[tuple[int, int]]:
    """Where each tensor's bytes lie in the file (found by searching for them: torch does not say)."""
    data = path.read_bytes()
    found = []
    for name, tensor in tensors.items():
        raw = tensor.numpy().tobytes()  # type: ignore[attr-defined]
        at = data.find(raw[:4096])
        assert at >= 0, name
        found.append((at, at + len(raw)))
    return found


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_info_of_a_64_mib_checkpoint_reads_under_1_mib_and_no_tensor_data(
    nginx: Nginx, tmp_path: Path, legacy: bool
) -> None:
    local = tmp_path / "pytorch_model.bin"
    tensors = checkpoint(local, 64, legacy)
    assert local.stat().st_size > 63 * MIB
    url = nginx.put("pytorch_model.bin", local.read_bytes())
    nginx.log.clear()

    result = run([sys.executable, "-m", "stfs", "info", url, "--json"])

    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert len(document["models"][0]["tensors"]) == len(tensors)
    transfer = nginx.log.transfer()
    assert transfer.bytes <= MIB, transfer
    assert document["transfer"]["bytes"] == transfer.bytes
    stored = data_ranges(local, tensors)
    for entry in nginx.log.entries():  # the first read (100,000 bytes from 0, before the format is known) aside,
        lo = int(entry.range.removeprefix("bytes=").partition("-")[0])  # no request asks for a tensor's bytes
        assert not any(begin <= lo < end for begin, end in stored), (entry.range, stored)


def test_a_bin_only_hub_repository_mounts_and_serves_safetensors(hub: FakeHub, mount: MountFn, tmp_path: Path) -> None:
    from safetensors import safe_open

    local = tmp_path / "pytorch_model.bin"
    tensors = checkpoint(local, 8)
    files = {
        "pytorch_model.bin": local.read_bytes(),
        "config.json": b'{"model_type": "opt"}\n',
        "README.md": b"# a model from before safetensors\n",
    }
    hub.publish_repo("org", "old-model", files)

    info = run([sys.executable, "-m", "stfs", "info", "hf://org/old-model", "--json"])
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["transfer"]["bytes"] <= MIB  # the pickle and directory, not 8 MiB of weights
    assert hub.cdn_log.transfer().bytes <= MIB

    mnt = mount("hf://org/old-model", options=["view=safetensors"])
    assert {"files", "header.json", "safetensors", "tensors"} <= set(os.listdir(mnt))
    assert sorted(os.listdir(Path(mnt, "safetensors"))) == ["README.md", "config.json", "model.safetensors"]
    name = "model.layers.47.weight"
    assert Path(mnt, "tensors", *name.split(".")).read_bytes() == tensors[name].numpy().tobytes()  # type: ignore[attr-defined]
    with safe_open(str(Path(mnt, "safetensors", "model.safetensors")), framework="pt") as opened:
        assert opened.metadata() == {"format": "pt"}
        assert sorted(opened.keys()) == sorted(tensors)
        for key, tensor in tensors.items():
            assert torch.equal(opened.get_tensor(key), tensor), key


def test_the_storages_local_headers_are_asked_for_at_once(
    nginx: Nginx, fault_proxy: Callable[[str], FaultProxy], tmp_path: Path
) -> None:
    """A zip's storages each have a local header to read (where the data starts): the requests for them are in
    flight together, not one after another. The proxy holds each request until 4 wait or half a second passes."""
    local = tmp_path / "pytorch_model.bin"
    tensors = checkpoint(local, 4)
    url = nginx.put("pytorch_model.bin", local.read_bytes())
    proxy = fault_proxy(nginx.url)
    held = threading.Condition()
    waiting = [0, 0]  # now, the most at once

    def hold(number: int, method: str, target: str) -> None:
        with held:
            waiting[0] += 1
            waiting[1] = max(waiting[1], waiting[0])
            held.notify_all()
            held.wait_for(lambda: waiting[0] >= 4, timeout=0.5)
            waiting[0] -= 1

    proxy.on_request(hold)
    result = run([sys.executable, "-m", "stfs", "info", url.replace(nginx.url, proxy.url), "--json"])

    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["models"][0]["tensors"]) == len(tensors)
    assert proxy.stats().requests > len(tensors)  # a request per storage, and the archive's directory
    assert waiting[1] >= 4


def test_diff_of_a_remote_checkpoint_against_its_safetensors_conversion(nginx: Nginx, tmp_path: Path) -> None:
    """``stfs diff URL-of-a-.bin local.safetensors``: identical, a transposed weight compared in C order, each
    tensor byte fetched about once (SPEC §10: at most 1.1 x the bytes compared)."""
    from safetensors.torch import save_file

    local = tmp_path / "pytorch_model.bin"
    tensors = checkpoint(local, 8)
    tensors["lm_head.weight"] = torch.randn(256, 512).t()  # a transpose: gathered from its storage
    torch.save(tensors, local)
    converted = tmp_path / "model.safetensors"
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(converted))  # type: ignore[attr-defined]
    url = nginx.put("pytorch_model.bin", local.read_bytes())
    nginx.log.clear()

    result = run([sys.executable, "-m", "stfs", "diff", "--json", url, str(converted)])

    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["summary"]["identical"] == len(tensors)
    compared = sum(t.numel() * t.element_size() for t in tensors.values())  # type: ignore[attr-defined]
    fetched = nginx.log.transfer().bytes
    assert compared <= fetched <= 1.1 * compared + MIB, (fetched, compared)  # the pickle's reads on top

    changed = dict(tensors)
    changed["lm_head.weight"] = tensors["lm_head.weight"].clone()  # type: ignore[attr-defined]
    changed["lm_head.weight"][300, 7] = float("nan")
    torch.save(changed, tmp_path / "nan.bin")
    url = nginx.put("nan.bin", (tmp_path / "nan.bin").read_bytes())
    result = run([sys.executable, "-m", "stfs", "check", "--values", url])
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{url}: tensor 'lm_head.weight': 1 NaN, 0 +inf, 0 -inf, the first at [300, 7]" in result.stdout
