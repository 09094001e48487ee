"""``stfs diff`` and ``stfs check --values`` over remote sources (SPEC §10): both sides over HTTP with each byte
fetched about once (nginx's access log), and a local copy against the Hub whose sha256s spare every tensor fetch."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch

from stfs.cli import main
from stfs.sources.remote import FIRST_READ
from tests.remote_helpers import files_of, publish_nginx, publish_s3
from tests.servers import S3, FakeHub, LogEntry, Nginx
from tests.torch_models import write, write_shards

pytestmark = pytest.mark.timeout(120)


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """About 20 MiB of BF16 and F32 tensors, of sizes no block or chunk divides."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(3000, 1024, generator=generator).to(torch.bfloat16),
        "layers.0.weight": torch.randn(1024, 1500, generator=generator),
        "layers.1.weight": torch.randn(999, 1001, generator=generator).to(torch.bfloat16),
        "norm.weight": torch.randn(1024, generator=generator),
    }


def data_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def diff_json(*argv: str) -> tuple[int, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["diff", "--json", *argv])
    return code, json.loads(out.getvalue())


def fetched(entries: list[LogEntry], suffix: str = ".safetensors") -> dict[str, list[tuple[int, int]]]:
    """The byte ranges fetched of each file whose path ends with ``suffix``."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for entry in entries:
        path = entry.uri.partition("?")[0]
        if not path.endswith(suffix) or entry.method != "GET":
            continue
        match = re.fullmatch(r"bytes (\d+)-(\d+)/\d+", entry.content_range)
        lo, hi = (int(match[1]), int(match[2]) + 1) if match else (0, entry.body_bytes)
        ranges.setdefault(path, []).append((lo, hi))
    return ranges


def test_both_sides_over_http_fetch_each_byte_about_once(nginx: Nginx, tmp_path: Path) -> None:
    tensors = weights()
    changed = dict(tensors)
    changed["layers.0.weight"] = tensors["layers.0.weight"].clone()
    changed["layers.0.weight"][1000, 1400] = 7.0  # late in a tensor: its equal start is needed again for ‖a‖
    write(tmp_path / "a" / "model.safetensors", tensors)
    write_shards(tmp_path / "b", changed, shards=2)
    base_a = publish_nginx(nginx, tmp_path / "a", "a")
    base_b = publish_nginx(nginx, tmp_path / "b", "b")
    nginx.log.clear()
    code, document = diff_json(f"{base_a}/model.safetensors", f"{base_b}/model.safetensors.index.json")
    assert code == 1
    [entry] = [t for t in document["tensors"] if t["status"] != "identical"]
    assert (entry["name"], entry["differ"], entry["where"]) == ("layers.0.weight", 1, [1000, 1400])
    assert entry["max_abs"] == abs(7.0 - tensors["layers.0.weight"][1000, 1400].double().item())
    entries = nginx.log.entries()
    compared = 2 * data_bytes(tensors)
    body = sum(e.body_bytes for e in entries)
    assert body <= 1.1 * compared, f"fetched {body} bytes to compare {compared}"
    for path, ranges in fetched(entries).items():  # no byte range of a file asked for twice
        ranges.sort()
        overlap = sum(max(0, prev[1] - cur[0]) for prev, cur in zip(ranges, ranges[1:], strict=False))
        assert overlap <= FIRST_READ, (path, ranges)


def test_check_values_over_http(nginx: Nginx, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors = weights()
    tensors["layers.1.weight"] = tensors["layers.1.weight"].clone()
    tensors["layers.1.weight"][998, 1000] = float("-inf")
    write(tmp_path / "m" / "x.safetensors", tensors)
    url = publish_nginx(nginx, tmp_path / "m", "m")
    nginx.log.clear()
    assert main(["check", "--values", f"{url}/x.safetensors"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{url}/x.safetensors: tensor 'layers.1.weight': 0 NaN, 0 +inf, 1 -inf, the first at [998, 1000]"
    body = sum(e.body_bytes for e in nginx.log.entries())
    assert body <= 1.1 * data_bytes(tensors)


def test_s3_against_a_local_copy(s3: S3, tmp_path: Path) -> None:
    tensors = weights()
    write_shards(tmp_path / "remote", tensors, shards=2)
    url = publish_s3(s3, tmp_path / "remote", "models", "toy")
    changed = dict(tensors)
    changed["norm.weight"] = tensors["norm.weight"].clone()
    changed["norm.weight"][100] = float("inf")
    local = write(tmp_path / "local" / "model.safetensors", changed)
    code, document = diff_json(f"{url}/", local)
    assert code == 1
    [entry] = [t for t in document["tensors"] if t["status"] != "identical"]
    assert (entry["name"], entry["differ"], entry["max_abs"], entry["where"]) == ("norm.weight", 1, None, None)
    assert document["a"] == f"{url}/"


def cdn_data_requests(hub: FakeHub) -> list[LogEntry]:
    """Requests of the Hub's CDN past the first read of a file (a header's): tensor bytes."""
    return [e for e in hub.cdn_log.entries() if not e.range.startswith("bytes=0-")]


def test_a_local_copy_identical_to_the_hub_fetches_no_tensor_bytes(hub: FakeHub, tmp_path: Path) -> None:
    local = tmp_path / "download"
    index = write_shards(local, weights(), shards=2)
    (local / "config.json").write_text('{"model_type": "toy"}')
    hub.publish_repo("org", "model", files_of(local))
    hub.cdn_log.clear()
    code, document = diff_json(str(local), "hf://org/model")
    assert code == 0
    assert document["summary"]["identical"] == 4
    assert cdn_data_requests(hub) == []
    assert sum(e.body_bytes for e in hub.cdn_log.entries()) <= 3 * FIRST_READ  # the index and two headers
    code, document = diff_json("hf://org/model", index)  # either way round, an index for a folder
    assert code == 0 and cdn_data_requests(hub) == []


def test_a_changed_local_file_is_compared_and_the_others_are_not_fetched(hub: FakeHub, tmp_path: Path) -> None:
    local = tmp_path / "download"
    tensors = weights()
    write_shards(local, tensors, shards=2)
    hub.publish_repo("org", "model", files_of(local))
    weight_map = json.loads((local / "model.safetensors.index.json").read_text())["weight_map"]
    broken_shard = weight_map["layers.0.weight"]
    changed = {name: t for name, t in tensors.items() if weight_map[name] == broken_shard}
    changed["layers.0.weight"] = changed["layers.0.weight"].clone()
    changed["layers.0.weight"][3, 4] = 0.5
    write(local / broken_shard, changed)  # the same size, other bytes: another sha256
    hub.cdn_log.clear()
    code, document = diff_json(str(local), "hf://org/model")
    assert code == 1
    [entry] = [t for t in document["tensors"] if t["status"] != "identical"]
    assert (entry["name"], entry["where"]) == ("layers.0.weight", [3, 4])
    data = cdn_data_requests(hub)
    assert data and {e.uri.rsplit("/", 1)[-1] for e in data} == {broken_shard}
    shard_bytes = sum(t.numel() * t.element_size() for t in changed.values())
    assert sum(e.body_bytes for e in data) <= 1.1 * shard_bytes


def test_two_hub_repositories_with_the_same_files_cost_no_data(hub: FakeHub, tmp_path: Path) -> None:
    local = tmp_path / "m"
    write(local / "model.safetensors", weights())
    hub.publish_repo("org", "one", files_of(local))
    hub.publish_repo("org", "two", files_of(local))
    hub.cdn_log.clear()
    code, document = diff_json("hf://org/one", "hf://org/two/model.safetensors")
    assert code == 0 and document["summary"]["identical"] == 4
    assert cdn_data_requests(hub) == []


def test_remote_trouble_is_exit_2_in_one_line(nginx: Nginx, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path / "a.safetensors", {"w": torch.ones(4)})
    assert main(["diff", str(tmp_path / "a.safetensors"), f"{nginx.url}/missing.safetensors"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "missing.safetensors" in err
