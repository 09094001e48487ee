"""``--cache-dir`` keeps every range a mount fetched (SPEC §7), pieces of blocks included: a later mount, or another
daemon sharing the folder, serves any read the kept ranges cover without a request, and fetches only the gaps of a
read they half cover. What went over the wire is read from nginx's log."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors import safe_open

from stfs.daemon import mounted
from tests.helpers import read_cold, run, tensor_path
from tests.models import tensor_bytes
from tests.remote_helpers import MIB, big_model
from tests.servers import Nginx, wait_until

pytestmark = pytest.mark.timeout(180)

TENSORS = 6
TENSOR_BYTES = 4 * MIB  # smaller than a block (8 MiB): a fetch clipped to one never fills a block
NAMES = [f"layers.{i}.weight" for i in range(TENSORS)]


@pytest.fixture
def model(nginx: Nginx, tmp_path: Path) -> tuple[Path, str]:
    local = big_model(tmp_path / "mid.safetensors", TENSORS, TENSOR_BYTES)
    return local, nginx.put("mid.safetensors", local.read_bytes())


@contextlib.contextmanager
def cache_mount(url: str, cache: Path, tmp_path: Path, nginx: Nginx) -> Iterator[str]:
    """A mount of ``url`` keeping what it fetches in ``cache``; nginx's log cleared once it is ready (its first
    read, which pins the object's version, is the mount's own); unmounted, and its daemon ended, after the block."""
    mnt = tmp_path / f"mnt{len(list(tmp_path.glob('mnt*')))}"
    mnt.mkdir()
    with mounted(url, str(mnt), options=[f"cache_dir={cache}"]) as mountpoint:
        nginx.log.clear()
        yield mountpoint


def fetched(nginx: Nginx) -> list[tuple[int, int]]:
    """The byte ranges ``[lo, hi)`` the server sent since the log was last cleared, sorted."""
    found = []
    for entry in nginx.log.entries():
        assert entry.range.startswith("bytes="), entry
        lo, _, hi = entry.range[len("bytes=") :].partition("-")
        found.append((int(lo), int(hi) + 1))
    return sorted(found)


def span(local: Path, name: str) -> tuple[int, int]:
    """Where tensor ``name``'s bytes are in the file."""
    with open(local, "rb") as stream:
        size = int.from_bytes(stream.read(8), "little")
        header = json.loads(stream.read(size))
    begin, end = header[name]["data_offsets"]
    return 8 + size + begin, 8 + size + end


def sha256sum(path: str) -> str:
    result = run(["sha256sum", path])
    assert result.returncode == 0, result.stderr
    return result.stdout.split()[0]


def sha256sum_of(local: Path, name: str) -> str:
    return hashlib.sha256(tensor_bytes(str(local), name)).hexdigest()


def test_tensors_read_one_at_a_time_cost_no_request_on_the_next_mount(
    nginx: Nginx, model: tuple[Path, str], tmp_path: Path, require_fuse: None
) -> None:
    local, url = model
    cache = tmp_path / "cache"
    expected = {name: sha256sum_of(local, name) for name in NAMES}
    with cache_mount(url, cache, tmp_path, nginx) as mnt:
        for name in (NAMES[1], NAMES[4]):
            assert sha256sum(tensor_path(mnt, name)) == expected[name]
        assert fetched(nginx)  # it came from the server this time
    with cache_mount(url, cache, tmp_path, nginx) as mnt:
        for name in (NAMES[1], NAMES[4]):
            assert sha256sum(tensor_path(mnt, name)) == expected[name]
        assert fetched(nginx) == []
        # a tensor not read before comes from the server, and only its bytes
        assert sha256sum(tensor_path(mnt, NAMES[2])) == expected[NAMES[2]]
        lo, hi = span(local, NAMES[2])
        got = fetched(nginx)
        assert got and all(lo <= a < b <= hi for a, b in got), got


def test_safe_open_of_one_tensor_costs_no_request_on_the_next_mount(
    nginx: Nginx, model: tuple[Path, str], tmp_path: Path, require_fuse: None
) -> None:
    local, url = model
    cache = tmp_path / "cache"
    name = NAMES[3]
    for attempt in range(2):
        with cache_mount(url, cache, tmp_path, nginx) as mnt:
            with safe_open(os.path.join(mnt, "files", "mid.safetensors"), framework="numpy") as opened:
                assert opened.get_tensor(name).tobytes() == tensor_bytes(str(local), name)
            assert bool(fetched(nginx)) == (attempt == 0), fetched(nginx)


def test_a_whole_file_read_with_cat_costs_no_request_on_the_next_mount(
    nginx: Nginx, model: tuple[Path, str], tmp_path: Path, require_fuse: None
) -> None:
    local, url = model
    cache = tmp_path / "cache"
    with cache_mount(url, cache, tmp_path, nginx) as mnt:  # tensors first, in file order: pieces of blocks
        for name in NAMES:
            assert read_cold(tensor_path(mnt, name)) == tensor_bytes(str(local), name)
    for attempt in range(2):
        with cache_mount(url, cache, tmp_path, nginx) as mnt:
            copy = tmp_path / "copy.safetensors"
            assert run(["sh", "-c", f'cat "{mnt}/files/mid.safetensors" > "{copy}"']).returncode == 0
            assert copy.read_bytes() == local.read_bytes()
            assert fetched(nginx) == [], attempt


def test_a_read_half_covered_by_kept_ranges_fetches_only_its_gap(
    nginx: Nginx, model: tuple[Path, str], tmp_path: Path, require_fuse: None
) -> None:
    local, url = model
    cache = tmp_path / "cache"
    name = NAMES[2]
    lo, hi = span(local, name)
    with cache_mount(url, cache, tmp_path, nginx) as mnt:
        path = tensor_path(mnt, name)
        fd = os.open(path, os.O_RDONLY)
        try:  # one MiB from the middle, and nothing the kernel would read ahead of it
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            assert os.pread(fd, MIB, MIB) == tensor_bytes(str(local), name)[MIB : 2 * MIB]
        finally:
            os.close(fd)
        first = fetched(nginx)
    assert first and all(lo <= a < b <= hi for a, b in first), first
    assert sum(b - a for a, b in first) < TENSOR_BYTES  # half covered, not whole

    with cache_mount(url, cache, tmp_path, nginx) as mnt:
        assert read_cold(tensor_path(mnt, name)) == tensor_bytes(str(local), name)
        second = fetched(nginx)
    # the rest of the tensor, and nothing of what the first mount fetched
    assert all(b <= c or d <= a for a, b in second for c, d in first), (first, second)
    assert merge(first + second) == [(lo, hi)], (first, second)


def merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def test_two_daemons_sharing_a_cache_dir_serve_each_others_fetches(
    nginx: Nginx, model: tuple[Path, str], tmp_path: Path, require_fuse: None
) -> None:
    local, url = model
    cache = tmp_path / "cache"
    with cache_mount(url, cache, tmp_path, nginx) as first, cache_mount(url, cache, tmp_path, nginx) as second:
        total = 0
        for reader, other, name in ((first, second, NAMES[0]), (second, first, NAMES[5])):
            nginx.log.clear()
            assert read_cold(tensor_path(reader, name)) == tensor_bytes(str(local), name)
            total += sum(b - a for a, b in fetched(nginx))
            assert total
            # its daemon writes what it fetched after the read, off the read path: wait until the folder has it
            wait_until(lambda total=total: kept_bytes(cache) >= total, 20, "the pieces written")
            nginx.log.clear()
            assert read_cold(tensor_path(other, name)) == tensor_bytes(str(local), name)
            assert fetched(nginx) == [], name


def kept_bytes(cache: Path) -> int:
    """The bytes of the pieces in ``cache`` (pieces being written, named ``*.tmp``, aside)."""
    return sum(p.stat().st_size for p in cache.rglob("*-*") if p.is_file() and not p.name.endswith(".tmp"))


def test_a_remote_mount_logs_no_line_about_libfuse_threads(
    nginx: Nginx, model: tuple[Path, str], tmp_path: Path, require_fuse: None
) -> None:
    # A remote mount serves with libfuse's thread pool; libfuse 3.12-3.14 warned at each such mount that the
    # number of idle threads it starts with is invalid.
    local, url = model
    log, mnt = tmp_path / "daemon.log", tmp_path / "mnt"
    mnt.mkdir()
    command = [sys.executable, "-m", "stfs", "mount", url, str(mnt), "--log-file", str(log)]
    assert subprocess.run(command, capture_output=True, text=True, timeout=60).returncode == 0
    try:
        assert read_cold(tensor_path(str(mnt), NAMES[0])) == tensor_bytes(str(local), NAMES[0])
    finally:
        run([sys.executable, "-m", "stfs", "unmount", str(mnt)])
    text = log.read_text()
    assert "serving" in text  # the daemon's log, libfuse's lines included, went there
    assert "max threads" not in text and "Ignoring" not in text, text
