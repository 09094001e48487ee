"""Who may read: the mounting user only by default; with allow_other everyone may read and nobody may write;
nothing outside the models is reachable; a busy mount says so and points to --lazy."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest

from stfs.daemon import mounted
from tests.helpers import run
from tests.models import tensor_bytes, write_numpy, write_sharded

pytestmark = pytest.mark.timeout(120)

AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


@pytest.fixture
def open_dir(require_fuse: None) -> Iterator[str]:
    """A folder every user can traverse (pytest's tmp_path is 0700 below /tmp/pytest-of-root)."""
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as another user")
    folder = tempfile.mkdtemp(prefix="stfs-perm-")
    os.chmod(folder, 0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def model(open_dir: str) -> str:
    arrays = {"model.w": np.arange(1000, dtype=np.float32), "model.b": np.ones(7, dtype=np.int8)}
    return write_numpy(os.path.join(open_dir, "m.safetensors"), arrays)


def _mountpoint(open_dir: str, name: str = "mnt") -> str:
    path = os.path.join(open_dir, name)
    os.makedirs(path, exist_ok=True)
    return path


def as_nobody(*command: str, text: bool = True) -> subprocess.CompletedProcess:
    return run([*AS_NOBODY, *command], text=text)


def test_by_default_only_the_mounting_user_reads(model: str, open_dir: str) -> None:
    with mounted(model, _mountpoint(open_dir)) as mnt:
        path = os.path.join(mnt, "tensors", "model", "w")
        with open(path, "rb") as stream:
            assert stream.read() == tensor_bytes(model, "model.w")
        for command in (["cat", path], ["ls", mnt], ["stat", mnt]):
            result = as_nobody(*command)
            assert result.returncode != 0
            assert "Permission denied" in result.stderr, result.stderr


def test_with_allow_other_others_read_but_never_write(model: str, open_dir: str) -> None:
    with mounted(model, _mountpoint(open_dir), options=["allow_other"]) as mnt:
        path = os.path.join(mnt, "tensors", "model", "w")
        result = as_nobody("cat", path, text=False)
        assert result.returncode == 0, result.stderr
        assert result.stdout == tensor_bytes(model, "model.w")
        assert as_nobody("ls", os.path.join(mnt, "tensors", "model")).stdout.split() == ["b", "w"]
        attempts = [
            ["sh", "-c", f"echo x >> {path}"],
            ["sh", "-c", f"echo x > {path}"],
            ["touch", os.path.join(mnt, "tensors", "new")],
            ["mkdir", os.path.join(mnt, "made")],
            ["rm", "-f", path],
            ["chmod", "0666", path],
            ["truncate", "-s", "0", path],
            ["mv", path, os.path.join(mnt, "tensors", "moved")],
            ["setfattr", "-n", "user.x", "-v", "1", path],
        ]
        for command in attempts:
            if shutil.which(command[0]) is None:
                continue
            result = as_nobody(*command)
            assert result.returncode != 0, command
            assert "Permission denied" in result.stderr or "Read-only file system" in result.stderr, (
                command,
                result.stderr,
            )
        with open(path, "rb") as stream:
            assert stream.read() == tensor_bytes(model, "model.w")
        modes = {
            stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode)
            for folder, folders, files in os.walk(mnt)
            for name in folders + files
        }
        assert modes == {0o444, 0o555}


HOSTILE_NAMES = ["..", ".", "../../etc/passwd", "a/../../b", "/abs/path", "x/./y", "..a..", "%2E%2E", "a\x00b"]


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_no_path_leads_outside_the_mount(open_dir: str, layout: str) -> None:
    arrays = {name: np.full(3, index, dtype=np.int16) for index, name in enumerate(HOSTILE_NAMES)}
    source = write_numpy(os.path.join(open_dir, "names.safetensors"), arrays)
    with mounted(source, _mountpoint(open_dir), layout=layout) as mnt:
        seen = {}
        for folder, folders, files in os.walk(mnt):
            for name in folders + files:
                path = os.path.join(folder, name)
                assert not os.path.islink(path), path
                assert os.path.realpath(path).startswith(mnt + os.sep), path
                if name in files and folder.startswith(os.path.join(mnt, "tensors")):
                    seen[os.getxattr(path, "user.safetensors.name").decode()] = path
        assert sorted(seen) == sorted(HOSTILE_NAMES)
        for name, path in seen.items():
            with open(path, "rb") as stream:
                assert stream.read() == arrays[name].tobytes()


ESCAPING_SHARDS = [
    "../outside.safetensors",
    "/ABS/outside.safetensors",
    "sub/../../outside.safetensors",
    "..\\outside.safetensors",
]


@pytest.mark.parametrize("shard", ESCAPING_SHARDS)
def test_an_index_may_not_name_a_shard_outside_its_folder(open_dir: str, shard: str) -> None:
    outside = write_numpy(os.path.join(open_dir, "outside.safetensors"), {"secret": np.arange(4, dtype=np.int32)})
    shard = shard.replace("/ABS", open_dir)
    folder = os.path.join(open_dir, "repo")
    os.makedirs(os.path.join(folder, "sub"), exist_ok=True)
    index = os.path.join(folder, "model.safetensors.index.json")
    with open(index, "w") as stream:
        json.dump({"weight_map": {"secret": shard}}, stream)
    mountpoint = _mountpoint(open_dir)
    result = run([sys.executable, "-m", "stfs", "mount", index, mountpoint])
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr and index in result.stderr
    assert not os.path.ismount(mountpoint)
    assert os.path.exists(outside)


def test_a_symlinked_shard_is_served_as_bytes_not_as_a_link(open_dir: str) -> None:
    """The Hugging Face cache links snapshot files to blobs/: the mount shows files, never links."""
    blobs = os.path.join(open_dir, "blobs")
    index = write_sharded(os.path.join(open_dir, "snapshot"), {"a.safetensors": {"w": np.arange(5, dtype=np.int64)}})
    os.makedirs(blobs)
    shard = os.path.join(os.path.dirname(index), "a.safetensors")
    os.replace(shard, os.path.join(blobs, "0123abcd"))
    os.symlink(os.path.join("..", "blobs", "0123abcd"), shard)
    with mounted(index, _mountpoint(open_dir)) as mnt:
        path = os.path.join(mnt, "tensors", "w")
        assert not os.path.islink(path) and stat.S_ISREG(os.lstat(path).st_mode)
        with open(path, "rb") as stream:
            assert stream.read() == np.arange(5, dtype=np.int64).tobytes()
        assert all(
            not os.path.islink(os.path.join(folder, name))
            for folder, folders, files in os.walk(mnt)
            for name in folders + files
        )


HOLDERS = {
    "cwd": "import sys; print('ready', flush=True); sys.stdin.read()",
    "open file": "import sys; f = open(sys.argv[1], 'rb'); print('ready', flush=True); sys.stdin.read()",
}


@pytest.mark.parametrize("holder", sorted(HOLDERS))
def test_unmounting_a_busy_mount_says_busy_and_lazy_works(model: str, open_dir: str, holder: str) -> None:
    with mounted(model, _mountpoint(open_dir)) as mnt:
        path = os.path.join(mnt, "tensors", "model", "w")
        process = subprocess.Popen(
            [sys.executable, "-c", HOLDERS[holder], path],
            cwd=mnt,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert process.stdout is not None and process.stdout.readline().strip() == "ready"
            result = run([sys.executable, "-m", "stfs", "unmount", mnt])
            assert result.returncode == 1
            assert "busy" in result.stderr and "--lazy" in result.stderr, result.stderr
            assert len(result.stderr.strip().splitlines()) == 1
            assert os.path.ismount(mnt)
            result = run([sys.executable, "-m", "stfs", "unmount", "--lazy", mnt])
            assert result.returncode == 0, result.stderr
            assert not os.path.ismount(mnt)
        finally:
            process.communicate(input="", timeout=30)
