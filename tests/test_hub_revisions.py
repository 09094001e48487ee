"""Every revision the Hub has (SPEC §7): a branch, a tag, a pull request's ``refs/pr/N`` (also spelled
``refs%2Fpr%2FN``), a full or short commit, each with an optional ``/PATH``; a mount is pinned to the commit the
revision resolves to, and ``user.safetensors.file`` names that commit."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import MountFn, read_cold, run, tensor_path
from tests.models import tensor_bytes, write_numpy
from tests.servers import FakeHub

pytestmark = pytest.mark.timeout(120)


def model(path: Path, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    write_numpy(str(path), {"w": rng.integers(0, 256, 5000, dtype=np.uint8), "b": np.arange(seed + 3)})
    return path.read_bytes()


@pytest.fixture
def repo(hub: FakeHub, tmp_path: Path) -> dict[str, tuple[str, bytes]]:
    """org/repo with a commit on main (tagged v1.0), a newer one on main, and a pull request's commit; each holds
    ``sub/model.safetensors`` with other tensors: revision name -> (commit, the model's bytes)."""
    found = {}
    for name, seed in (("v1.0", 1), ("main", 2), ("refs/pr/1", 3)):
        data = model(tmp_path / f"{seed}.safetensors", seed)
        branch = "refs/pr/1" if name == "refs/pr/1" else "main"
        commit = hub.publish_repo("org", "repo", {"sub/model.safetensors": data, "config.json": b"{}"}, branch)
        if name == "v1.0":
            hub.tag("org", "repo", "v1.0", commit)
        found[name] = (commit, data)
    return found


def info(source: str) -> dict:
    result = run([sys.executable, "-m", "stfs", "info", "--json", source])
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def spellings(repo: dict[str, tuple[str, bytes]]) -> list[tuple[str, str]]:
    """(revision as written in SOURCE, the revision it means)."""
    pr_commit = repo["refs/pr/1"][0]
    return [
        ("", "main"),
        ("@main", "main"),
        ("@v1.0", "v1.0"),
        ("@refs/pr/1", "refs/pr/1"),
        ("@refs%2Fpr%2F1", "refs/pr/1"),
        (f"@{pr_commit}", "refs/pr/1"),
        (f"@{pr_commit[:7]}", "refs/pr/1"),
        (f"@{repo['v1.0'][0][:12]}", "v1.0"),
    ]


def test_info_of_every_revision_spelling_with_and_without_a_path(hub: FakeHub, repo: dict) -> None:
    paths = ("", "/sub", "/sub/model.safetensors")
    for number, (written, meant) in enumerate(spellings(repo)):
        commit = repo[meant][0]
        path = paths[number % len(paths)]
        [found] = info(f"hf://org/repo{written}{path}")["models"]
        assert found["source"] == f"hf://org/repo@{commit}/sub/model.safetensors", (written, path)
        shapes = {t["name"]: t["shape"] for t in found["tensors"]}
        assert shapes["b"] == [{"v1.0": 4, "main": 5, "refs/pr/1": 6}[meant]], (written, path)


def test_a_mount_of_a_pull_request_is_pinned_to_its_commit(
    hub: FakeHub, repo: dict, mount: MountFn, tmp_path: Path
) -> None:
    commit, data = repo["refs/pr/1"]
    local = tmp_path / "pr.safetensors"
    local.write_bytes(data)
    mnt = mount("hf://org/repo@refs/pr/1/sub/model.safetensors")
    weight = tensor_path(mnt, "w")
    assert os.getxattr(weight, "user.safetensors.file").decode() == f"hf://org/repo@{commit}/sub/model.safetensors"
    assert read_cold(weight) == tensor_bytes(str(local), "w")
    assert read_cold(os.path.join(mnt, "files", "model.safetensors")) == data
    # the pull request moves on: the mount keeps the commit it resolved to
    hub.publish_repo("org", "repo", {"sub/model.safetensors": model(tmp_path / "9.safetensors", 9)}, "refs/pr/1")
    assert read_cold(tensor_path(mnt, "b")) == tensor_bytes(str(local), "b")
    assert json.loads(os.getxattr(mnt, "user.stfs.changed")) == [f"hf://org/repo@{commit}/sub/model.safetensors"]


def test_a_mount_of_a_tag_and_of_a_short_commit(hub: FakeHub, repo: dict, mount: MountFn, tmp_path: Path) -> None:
    for written in ("@v1.0", f"@{repo['v1.0'][0][:7]}"):
        commit, data = repo["v1.0"]
        local = tmp_path / "tag.safetensors"
        local.write_bytes(data)
        mnt = mount(f"hf://org/repo{written}/sub")
        weight = tensor_path(mnt, "w")
        assert os.getxattr(weight, "user.safetensors.file").decode() == f"hf://org/repo@{commit}/sub/model.safetensors"
        assert read_cold(weight) == tensor_bytes(str(local), "w")


@pytest.mark.parametrize("revision", ["refs/pr/7", "nope", "refs%2Fpr%2F7", "0123456"])
def test_a_revision_the_hub_lacks_is_one_line(hub: FakeHub, repo: dict, revision: str) -> None:
    for command in ("info", "check") if revision == "nope" else ("info",):
        result = run([sys.executable, "-m", "stfs", command, f"hf://org/repo@{revision}/sub"])
        assert result.returncode == 1, result.stderr
        output = (result.stdout + result.stderr).strip()
        assert len(output.splitlines()) == 1 and "Traceback" not in output, output
        shown = revision.replace("%2F", "/")
        assert f"hf://org/repo@{shown}" in output and "no such revision" in output, output
