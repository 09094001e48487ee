"""What goes over the wire (SPEC §7): `stfs info` and `stfs check` read headers only, in one speculative request
per shard (two for a bigger header), every shard at once; a server that ignores Range; the progress line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from stfs.sources.remote import FIRST_READ
from tests.helpers import read_cold, run, tensor_path
from tests.models import tensor_bytes, write_numpy, write_sharded
from tests.remote_helpers import MIB, big_header_model, big_model, wait_for, zero_model
from tests.servers import FaultProxy, Nginx

pytestmark = pytest.mark.timeout(120)


def stfs(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "stfs", *args], timeout=timeout)


def info_json(url: str) -> dict:
    result = stfs("info", url, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def header_length(path: Path) -> int:
    with open(path, "rb") as stream:
        return int.from_bytes(stream.read(8), "little")


def one_tensor(path: Path, size: int = MIB) -> Path:
    write_numpy(str(path), {"weight": np.arange(size, dtype=np.uint8)})
    return path


def test_info_of_a_small_header_is_one_speculative_request(nginx: Nginx, tmp_path: Path) -> None:
    local = one_tensor(tmp_path / "x.safetensors")
    assert header_length(local) <= 80  # {"weight": ...} and its padding
    url = nginx.put("x.safetensors", local.read_bytes())
    report = info_json(url)
    [entry] = nginx.log.entries(at_least=1)
    assert (entry.range, entry.status, entry.body_bytes) == (f"bytes=0-{FIRST_READ - 1}", 206, FIRST_READ)
    assert report["transfer"] == {"requests": 1, "bytes": FIRST_READ}
    assert report["models"][0]["tensors"][0]["file"] == url
    nginx.log.clear()
    result = stfs("check", url)
    assert result.returncode == 0 and result.stdout.strip() == f"{url}: ok (1 tensors)"
    assert [e.range for e in nginx.log.entries(at_least=1)] == [f"bytes=0-{FIRST_READ - 1}"]


def test_info_of_a_bigger_header_is_two_requests_and_never_the_data(nginx: Nginx, tmp_path: Path) -> None:
    local = big_header_model(tmp_path / "x.safetensors", 3 * FIRST_READ)
    length = header_length(local)
    url = nginx.put("x.safetensors", local.read_bytes())
    report = info_json(url)
    entries = nginx.log.entries(at_least=2)
    assert [e.range for e in entries] == [f"bytes=0-{FIRST_READ - 1}", f"bytes={FIRST_READ}-{8 + length - 1}"]
    assert sum(e.body_bytes for e in entries) == 8 + length  # the header, no byte of the data
    assert report["transfer"] == {"requests": 2, "bytes": 8 + length}
    assert report["models"][0]["metadata"]["pad"] == "x" * 3 * FIRST_READ


def _shards(folder: Path, count: int) -> Path:
    shards = {
        f"model-{s:05d}-of-{count:05d}.safetensors": {f"layers.{s}.weight": np.full(4096, s % 251, np.uint8)}
        for s in range(1, count + 1)
    }
    return Path(write_sharded(str(folder), shards))


def _publish(nginx: Nginx, folder: Path, prefix: str) -> None:
    for path in folder.iterdir():
        nginx.put(f"{prefix}/{path.name}", path.read_bytes())


def test_every_shard_header_is_read_at_once(
    nginx: Nginx, fault_proxy: Callable[[str], FaultProxy], tmp_path: Path
) -> None:
    count = 24
    index = _shards(tmp_path / "set", count)
    _publish(nginx, tmp_path / "set", "set")
    proxy = fault_proxy(nginx.url)
    # Hold every shard's request until four are in at once: a reader that asked one at a time would never get there.
    arrived: list[int] = []
    together = threading.Event()
    condition = threading.Condition()

    def hold(number: int, method: str, target: str) -> None:
        if "model-" not in target:
            return
        with condition:
            arrived.append(number)
            if len(arrived) >= 4:
                together.set()
                condition.notify_all()
            else:
                condition.wait_for(together.is_set, timeout=20)

    proxy.on_request(hold)
    report = info_json(f"{proxy.url}/set/{index.name}")
    assert together.is_set()
    assert report["totals"]["tensors"] == count
    assert report["transfer"]["requests"] == count + 1  # the index, then one request per shard
    entries = nginx.log.entries(at_least=count + 1)
    assert len(entries) == count + 1 and all(e.range == f"bytes=0-{FIRST_READ - 1}" for e in entries)
    assert len({e.connection for e in entries}) >= 4  # several connections: requests overlapped


# --- a server that ignores Range --------------------------------------------------------------------------


def test_info_and_check_read_only_what_they_need_from_a_server_that_ignores_range(
    nginx: Nginx, fault_proxy: Callable[[str], FaultProxy], tmp_path: Path
) -> None:
    local = zero_model(tmp_path / "big.safetensors", tensors=64, tensor_bytes=4 * MIB)  # 256 MiB
    nginx.put("big.safetensors", b"")
    shutil.copyfile(local, nginx.root / "big.safetensors")  # sparse copy is fine: zeros
    proxy = fault_proxy(nginx.url)
    proxy.set_ignore_range(True)
    url = f"{proxy.url}/big.safetensors"
    report = info_json(url)
    assert report["totals"] == {"tensors": 64, "parameters": 256 * MIB, "bytes": 256 * MIB}
    result = stfs("check", url)
    assert result.returncode == 0, result.stderr
    stats = proxy.stats()
    # Each command: the ranged GET (answered 200: obstore drops it unread), then one streamed and dropped early.
    assert (stats.requests, stats.ranges_stripped) == (4, 2)
    # The connection was dropped after the header: a few socket buffers at most went out, never the 256 MiB.
    assert stats.body_bytes < 64 * MIB
    assert report["transfer"]["requests"] == 2 and report["transfer"]["bytes"] <= 2 * FIRST_READ


def test_a_big_header_from_a_server_that_ignores_range(
    nginx: Nginx, fault_proxy: Callable[[str], FaultProxy], tmp_path: Path
) -> None:
    local = big_header_model(tmp_path / "x.safetensors", 3 * FIRST_READ, data_bytes=4 * MIB)
    nginx.put("x.safetensors", local.read_bytes())
    proxy = fault_proxy(nginx.url)
    proxy.set_ignore_range(True)
    report = info_json(f"{proxy.url}/x.safetensors")
    assert report["models"][0]["metadata"]["pad"] == "x" * 3 * FIRST_READ


def test_mount_reads_each_file_whole_once_from_a_server_that_ignores_range(
    nginx: Nginx, fault_proxy: Callable[[str], FaultProxy], tmp_path: Path
) -> None:
    """One GET of the whole file, front to back, into the cache: a read waits only for its own bytes (the first
    tensor comes while the rest still streams, at 4 MB/s here), and with --cache-dir the next mount reads it from
    disk (nginx names a version: its ETag)."""
    local = big_model(tmp_path / "x.safetensors", tensors=4, tensor_bytes=3 * MIB)
    nginx.put("x.safetensors", local.read_bytes())
    size = local.stat().st_size
    proxy = fault_proxy(nginx.url)
    proxy.set_ignore_range(True)
    url = f"{proxy.url}/x.safetensors"
    cache = tmp_path / "cache"
    for mount_number in (1, 2):
        mnt = tmp_path / f"mnt{mount_number}"
        mnt.mkdir()
        proxy.set_rate(4_000_000 if mount_number == 1 else 0)
        result = stfs("mount", url, str(mnt), "--cache-dir", str(cache), "--log-file", str(tmp_path / "log"))
        try:
            assert result.returncode == 0, result.stderr
            [line] = result.stderr.strip().splitlines()
            assert line == (
                f"stfs: warning: {url}: the server ignores Range requests; reading the whole file "
                f"({size / MIB:.1f} MiB) into the cache once, in {cache}"
            )
            before = proxy.stats()
            first = read_cold(tensor_path(str(mnt), "layers.0.weight"))
            assert first == tensor_bytes(str(local), "layers.0.weight")
            if mount_number == 1:
                assert proxy.stats().body_bytes - before.body_bytes < size  # the rest was still on its way
            for name in (f"layers.{i}.weight" for i in range(4)):
                assert read_cold(tensor_path(str(mnt), name)) == tensor_bytes(str(local), name), name
            assert read_cold(os.path.join(mnt, "files", "x.safetensors")) == local.read_bytes()
            whole = [r for r in proxy.requests() if r.number > before.requests and r.body_bytes == size]
            assert len(whole) == (1 if mount_number == 1 else 0)  # the second mount reads it from disk
        finally:
            if os.path.ismount(mnt):
                stfs("unmount", str(mnt))


# --- the progress line ------------------------------------------------------------------------------------


def test_a_progress_line_on_a_terminal_and_nothing_elsewhere(
    nginx: Nginx, fault_proxy: Callable[[str], FaultProxy], tmp_path: Path
) -> None:
    if shutil.which("script") is None:
        pytest.skip("no script(1) here")
    count = 40
    index = _shards(tmp_path / "set", count)
    _publish(nginx, tmp_path / "set", "set")
    proxy = fault_proxy(nginx.url)
    proxy.set_latency(0.6)  # 40 shards, 16 at a time: three rounds, well past the one second
    url = f"{proxy.url}/set/{index.name}"
    for name in ("tty", "pipe"):
        mnt = tmp_path / f"mnt-{name}"
        mnt.mkdir()
        command = [sys.executable, "-m", "stfs", "mount", url, str(mnt), "--log-file", str(tmp_path / "log")]
        if name == "tty":
            line = " ".join(f"'{part}'" for part in command)
            result = run(["script", "-q", "-e", "-c", line, "/dev/null"], timeout=60)
        else:
            result = run(command, timeout=60)
        try:
            assert result.returncode == 0, result.stdout + result.stderr
            wait_for(lambda m=mnt: os.path.ismount(m), 10, "mounted")
            if name == "tty":
                assert f"reading headers: {count}/{count}" in result.stdout
            else:
                assert result.stdout == "" and result.stderr == ""
        finally:
            if os.path.ismount(mnt):
                stfs("unmount", str(mnt))
