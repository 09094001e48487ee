"""Remote reads answered in C (issue 18): once Python has answered a read from a slot of the block cache, the bytes
it found there (clipped to the tensor read) are published to stfs._native, which answers the next reads of them by
splicing from the cache's memfd. Every byte right, also with libfuse's thread pool and slots reused under concurrent
readers; a changed object is EIO for cached blocks too; readahead still crosses tensors (test_remote_readahead runs
with this path on)."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stfs.daemon import mounted
from tests.helpers import read_cold, tensor_path
from tests.models import tensor_bytes
from tests.remote_helpers import MIB, big_model
from tests.servers import Nginx
from tests.test_native import BUILT

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not BUILT, reason="stfs._native is not built"),  # test_native fails CI without it
]

TENSORS, SIZE = 12, 3 * MIB + 4321  # tensor boundaries fall inside blocks


@pytest.fixture
def counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, require_fuse: None) -> Iterator[Path]:
    """The daemons of the test count their calls (written to this path when unmounted), on the C path."""
    stats = tmp_path / "stats.json"
    monkeypatch.setenv("STFS_STATS", str(stats))
    monkeypatch.delenv("STFS_NATIVE", raising=False)
    yield stats


def calls(stats: Path) -> dict[str, int]:
    return dict(json.loads(stats.read_text())["calls"])


def served(nginx: Nginx, tmp_path: Path) -> tuple[Path, str]:
    """The model, served; and the test's mountpoint made."""
    (tmp_path / "mnt").mkdir()
    local = big_model(tmp_path / "m.safetensors", TENSORS, SIZE)
    return local, nginx.put("m.safetensors", local.read_bytes())


def test_cached_blocks_are_answered_in_c_with_the_right_bytes(nginx: Nginx, tmp_path: Path, counted: Path) -> None:
    local, url = served(nginx, tmp_path)
    whole = local.read_bytes()
    with mounted(url, str(tmp_path / "mnt")) as mnt:
        for i in range(TENSORS):
            assert read_cold(tensor_path(mnt, f"layers.{i}.weight")) == tensor_bytes(str(local), f"layers.{i}.weight")
        assert read_cold(os.path.join(mnt, "files", "m.safetensors")) == whole
        for offset in (0, 4095, SIZE - 1, len(whole) // 2, len(whole) - 5000):  # the cache holds it all now
            assert read_cold(os.path.join(mnt, "files", "m.safetensors"), offset, 5000) == whole[offset : offset + 5000]
    answered = calls(counted)
    # one read a block, or a tensor's first read in it, goes to Python; C answers the rest
    assert answered.get("read_buf_cached", 0) > answered["read_buf"] // 2, answered


def test_the_daemons_threads_carry_their_jobs_names(nginx: Nginx, tmp_path: Path, counted: Path) -> None:
    """``top -H`` and ``perf report --sort comm`` tell the daemon's fetching from its answering: the threads that
    fetch blocks are ``stfs-fetch``, libfuse's that answer reads ``stfs-fuse`` (the kernel's names; Python keeps its
    own to itself)."""
    local, url = served(nginx, tmp_path)
    with mounted(url, str(tmp_path / "mnt")) as mnt:
        assert read_cold(os.path.join(mnt, "files", "m.safetensors")) == local.read_bytes()
        pid = int(os.getxattr(mnt, "user.stfs.pid"))
        names = {Path(task, "comm").read_text().strip() for task in Path(f"/proc/{pid}/task").iterdir()}
    assert {"stfs-fetch", "stfs-fuse"} <= names, names


@pytest.mark.parametrize("threads", [False, True], ids=["one thread", "thread pool"])
def test_slots_reused_under_concurrent_readers(nginx: Nginx, tmp_path: Path, counted: Path, threads: bool) -> None:
    """A 4 MiB cache (16 slots of 256 KiB) for a 36 MiB model: slots C is answering from are reused while other
    readers fetch; a slot is never refilled while a reply of C's holds its pages."""
    local, url = served(nginx, tmp_path)
    whole = local.read_bytes()
    tensors = [tensor_bytes(str(local), f"layers.{i}.weight") for i in range(TENSORS)]
    options = ["cache_size=4M", *(["threads"] if threads else [])]

    def reader(mnt: str, number: int) -> int:
        if number == 0:
            assert read_cold(os.path.join(mnt, "files", "m.safetensors")) == whole
        for step in range(30):
            i = (number * 7 + step * 5) % TENSORS
            offset = (step * 377_777 + number * 4099) % (SIZE - MIB)
            for _ in range(2):  # the second read of the same bytes finds them in the cache, if still there
                got = read_cold(tensor_path(mnt, f"layers.{i}.weight"), offset, 700_000)
                assert got == tensors[i][offset : offset + 700_000]
        return number

    with mounted(url, str(tmp_path / "mnt"), options=options) as mnt, ThreadPoolExecutor(5) as pool:
        assert sorted(pool.map(lambda n: reader(mnt, n), range(5))) == list(range(5))
    assert calls(counted).get("read_buf_cached", 0) > 0


def test_a_changed_object_is_eio_for_cached_blocks_too(nginx: Nginx, tmp_path: Path, counted: Path) -> None:
    local, url = served(nginx, tmp_path)
    first = tensor_bytes(str(local), "layers.0.weight")
    with mounted(url, str(tmp_path / "mnt")) as mnt:
        path = tensor_path(mnt, "layers.0.weight")
        assert read_cold(path) == first
        # past the first read's bytes (the header's, kept apart): from the block cache, in C
        assert read_cold(path, MIB, MIB) == first[MIB : 2 * MIB]
        nginx.replace("m.safetensors", local.read_bytes()[::-1])
        with pytest.raises(OSError) as raised:  # never fetched: the server says it changed (412)
            read_cold(tensor_path(mnt, f"layers.{TENSORS - 1}.weight"))
        assert raised.value.errno == errno.EIO
        with pytest.raises(OSError) as raised:  # cached, but the mount knows now: EIO, as from Python
            read_cold(path, MIB, MIB)
        assert raised.value.errno == errno.EIO
    assert calls(counted).get("read_buf_cached", 0) > 0
