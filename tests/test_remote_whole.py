"""A server that ignores Range, mounted (SPEC §7): ``python3 -m http.server``, the first server everyone starts. Each
file is read whole, once, front to back, into the cache (``--cache-dir`` when given, else memory within
``--cache-size``), with one warning saying so; a file that cannot fit is refused in one line naming the option that
would make it fit. ``stfs info`` still reads only the header."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stfs.sources.remote import FIRST_READ
from tests.helpers import read_cold, run, tensor_path
from tests.models import tensor_bytes
from tests.remote_helpers import MIB, big_model, zero_model
from tests.servers import StdlibHttpServer

pytestmark = pytest.mark.timeout(180)

TENSORS = 5
SIZE = 3 * MIB + 1234  # blocks and tensors do not line up


@contextlib.contextmanager
def mounted(url: str, tmp_path: Path, *options: str) -> Iterator[tuple[str, subprocess.CompletedProcess]]:
    """``stfs mount URL MNT OPTIONS`` (in the background, as a user runs it): the mountpoint and what the command
    said; unmounted after the block."""
    mnt = tmp_path / "mnt"
    mnt.mkdir(exist_ok=True)
    log = tmp_path / "stfs.log"
    result = run([sys.executable, "-m", "stfs", "mount", url, str(mnt), "--log-file", str(log), *options])
    try:
        assert result.returncode == 0, result.stderr + (log.read_text() if log.exists() else "")
        yield str(mnt), result
    finally:
        if os.path.ismount(mnt):
            run([sys.executable, "-m", "stfs", "unmount", str(mnt)])


@pytest.mark.parametrize("cache", ["memory", "disk"])
def test_a_model_from_python_http_server_is_read_whole_once(
    cache: str, http_server: StdlibHttpServer, tmp_path: Path
) -> None:
    path = big_model(http_server.root / "m.safetensors", TENSORS, SIZE)
    url = f"{http_server.url}/m.safetensors"
    size = path.stat().st_size
    options = ["--cache-dir", str(tmp_path / "cache")] if cache == "disk" else ["--cache-size", "64M"]
    with mounted(url, tmp_path, *options) as (mnt, result):
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"stfs: warning: {url}: the server ignores Range requests; ")
        assert f"reading the whole file ({size / MIB:.1f} MiB) into the cache once" in line
        at_mount = len(http_server.gets())
        for i in reversed(range(TENSORS)):  # last first: a read waits only for its own bytes, in any order
            name = f"layers.{i}.weight"
            assert read_cold(tensor_path(mnt, name)) == tensor_bytes(str(path), name), name
        assert subprocess.run(["cmp", str(path), os.path.join(mnt, "files", "m.safetensors")]).returncode == 0
        assert read_cold(os.path.join(mnt, "files", "m.safetensors")) == path.read_bytes()
        assert http_server.gets()[at_mount:] == [("/m.safetensors", 200)]  # one GET for every read


def test_a_file_bigger_than_the_memory_cache_is_refused_in_one_line(
    http_server: StdlibHttpServer, tmp_path: Path
) -> None:
    zero_model(http_server.root / "big.safetensors", tensors=10, tensor_bytes=4 * MIB)  # 40 MiB
    url = f"{http_server.url}/big.safetensors"
    mnt = tmp_path / "refused"
    mnt.mkdir()
    for foreground in ([], ["-f"]):
        result = run([sys.executable, "-m", "stfs", "mount", url, str(mnt), "--cache-size", "16M", *foreground])
        assert result.returncode == 1, result.stderr
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"stfs: {url}: the server ignores Range requests") and "40.0 MiB" in line, line
        assert "--cache-size" in line and "--cache-dir" in line, line
        assert not os.path.ismount(mnt)
    # on disk it fits, whatever --cache-size
    with mounted(url, tmp_path, "--cache-size", "16M", "--cache-dir", str(tmp_path / "cache")) as (mounted_at, _):
        assert read_cold(tensor_path(mounted_at, "layers.9.weight")) == bytes(4 * MIB)


def test_info_reads_only_the_header_from_python_http_server(http_server: StdlibHttpServer) -> None:
    zero_model(http_server.root / "big.safetensors", tensors=64, tensor_bytes=4 * MIB)  # 256 MiB
    result = run([sys.executable, "-m", "stfs", "info", "--json", f"{http_server.url}/big.safetensors"])
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["totals"]["tensors"] == 64
    assert report["transfer"]["requests"] == 2 and report["transfer"]["bytes"] <= 2 * FIRST_READ
