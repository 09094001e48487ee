"""Caches of a remote mount (SPEC §7): the daemon's memory stays under --cache-size + 150 MiB while it serves a
model larger than the cache; --cache-dir serves a second mount (and a second daemon at once) without the server,
keyed by object and version."""

from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stfs.daemon import daemon_pid
from tests.helpers import MountFn, read_cold, rss_memory, tensor_path
from tests.models import tensor_bytes
from tests.remote_helpers import MIB, big_model, zero_model
from tests.servers import Nginx, wait_until

pytestmark = pytest.mark.timeout(120)


def test_memory_stays_under_the_cache_size_reading_a_larger_model(nginx: Nginx, mount: MountFn, tmp_path: Path) -> None:
    tensors, size = 64, 8 * MIB  # 512 MiB of zeros, written sparsely
    local = zero_model(tmp_path / "big.safetensors", tensors, size)
    nginx.put("big.safetensors", b"")
    shutil.copyfile(local, nginx.root / "big.safetensors")
    mnt = mount(f"{nginx.url}/big.safetensors", options=["cache_size=64M"])
    pid = daemon_pid(mnt)
    assert pid
    peak = [rss_memory(pid)]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak.append(rss_memory(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    zeros = bytes(size)
    try:
        for i in range(tensors):
            assert read_cold(tensor_path(mnt, f"layers.{i}.weight")) == zeros
    finally:
        done.set()
        sampler.join(5)
    read = sum(entry.body_bytes for entry in nginx.log.entries())
    assert read >= tensors * size  # it all came over the wire, through the daemon
    assert max(peak) < (64 + 150) * MIB, f"RssAnon + RssShmem peaked at {max(peak) / MIB:.0f} MiB"


def _read_all(mnt: str, names: list[str]) -> dict[str, bytes]:
    return {name: read_cold(tensor_path(mnt, name)) for name in names}


def test_a_cache_dir_serves_other_mounts_without_the_server(nginx: Nginx, mount: MountFn, tmp_path: Path) -> None:
    local = big_model(tmp_path / "m.safetensors", 4, 3 * MIB + 999)
    names = [f"layers.{i}.weight" for i in range(4)]
    expected = {name: tensor_bytes(str(local), name) for name in names}
    url = nginx.put("m.safetensors", local.read_bytes())
    cache = tmp_path / "cache"
    options = [f"cache_dir={cache}"]
    first, second = mount(url, options=options), mount(url, options=options)
    with ThreadPoolExecutor(2) as pool:  # two daemons filling one folder at once
        for got in pool.map(lambda mnt: _read_all(mnt, names), [first, second]):
            assert got == expected
    # readahead may still be writing a block the readers did not wait for: every temporary becomes a piece
    wait_until(lambda: not [p for p in cache.rglob("*") if p.name.endswith(".tmp")], 10, "pieces being written")

    nginx.log.clear()
    third = mount(url, options=options)
    assert _read_all(third, names) == expected
    ranges = [entry.range for entry in nginx.log.entries()]
    assert ranges == ["bytes=0-99999"]  # the mount's first read (it pins the version); no byte of data

    # another version of the object: the pieces kept are not its pieces
    newer = big_model(tmp_path / "n.safetensors", 4, 3 * MIB + 999, seed=9)
    nginx.replace("m.safetensors", newer.read_bytes())
    nginx.log.clear()
    fourth = mount(url, options=options)
    assert _read_all(fourth, names) == {name: tensor_bytes(str(newer), name) for name in names}
    assert sum(entry.body_bytes for entry in nginx.log.entries()) >= 4 * (3 * MIB + 999)
    assert os.path.ismount(first)


def _shmem(pid: int) -> int:
    with open(f"/proc/{pid}/status") as stream:
        return next(int(line.split()[1]) * 1024 for line in stream if line.startswith("RssShmem:"))


@pytest.mark.parametrize(("cache_size", "pool"), [("64M", 20 * 2 * MIB), ("4M", 12 * 256 * 1024)])
def test_a_mount_faults_in_a_bounded_pool_of_slots_before_any_read(
    cache_size: str, pool: int, nginx: Nginx, mount: MountFn, tmp_path: Path
) -> None:
    # 64M: 2 MiB slots, a window of 8, twice the window and 4 more faulted in; 4M: 256 KiB slots, a window of 4
    local = big_model(tmp_path / "m.safetensors", 3, 3 * MIB + 999)
    mnt = mount(nginx.put("m.safetensors", local.read_bytes()), options=[f"cache_size={cache_size}"])
    pid = daemon_pid(mnt)
    assert pid
    nginx.log.clear()
    wait_until(lambda: _shmem(pid) >= pool, 10, "the pool of slots faulted in")
    assert _shmem(pid) == pool  # a bounded pool, inside a small --cache-size too
    assert nginx.log.entries() == []  # faulted in, not fetched
    assert read_cold(tensor_path(mnt, "layers.1.weight")) == tensor_bytes(str(local), "layers.1.weight")
