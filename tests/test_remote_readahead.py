"""Readahead that follows a loader (SPEC §7, issue 18): a reader going through a model in file order, through
``tensors/`` or ``files/``, keeps fetching ahead across tensor boundaries; a reader that jumps to one tensor through
``files/`` (safe_open's ``mmap``) fetches only around it; the block cache under eviction with concurrent readers.
Byte counts come from nginx's access log."""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from stfs.daemon import daemon_pid, mounted
from stfs.model import resolve, source_files
from stfs.nodes import DirNode
from stfs.readahead import jump_window_kb
from stfs.sources import LocalFiles
from stfs.sources.remote import DEFAULT_BLOCK_SIZE
from stfs.tree import Tree
from stfs.views import build_tree
from tests.helpers import MountFn, read_cold, rss_memory, tensor_path
from tests.models import tensor_bytes, write_sharded
from tests.remote_helpers import MIB, big_model
from tests.servers import Nginx

pytestmark = pytest.mark.timeout(120)

TENSORS, SIZE = 12, 3 * MIB + 4321  # not block-aligned: tensor boundaries fall inside blocks
assert SIZE < DEFAULT_BLOCK_SIZE


def named_spans(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's [start, end) in the file, by name."""
    with open(path, "rb") as stream:
        length = int.from_bytes(stream.read(8), "little")
        header = json.loads(stream.read(length))
    header.pop("__metadata__", None)
    return {name: (8 + length + e["data_offsets"][0], 8 + length + e["data_offsets"][1]) for name, e in header.items()}


def spans(path: Path) -> list[tuple[int, int]]:
    """Each tensor's [start, end) in the file, in file order."""
    return sorted(named_spans(path).values())


def fetched_ranges(nginx: Nginx, name: str) -> list[tuple[int, int]]:
    ranges = []
    for entry in nginx.log.entries():
        if name in entry.uri and entry.range:
            lo, hi = entry.range.removeprefix("bytes=").split("-")
            ranges.append((int(lo), int(hi) + 1))
    return sorted(ranges)


def crossing(ranges: list[tuple[int, int]], boundaries: list[int]) -> int:
    """How many fetches hold a tensor boundary strictly inside them: fetched ahead across tensors."""
    return sum(any(lo < b < hi for b in boundaries) for lo, hi in ranges)


@pytest.fixture
def served(nginx: Nginx, tmp_path: Path) -> tuple[Path, str]:
    local = big_model(tmp_path / "m.safetensors", TENSORS, SIZE)
    return local, nginx.put("m.safetensors", local.read_bytes())


@pytest.mark.parametrize("through", ["tensors", "files"])
def test_a_reader_in_file_order_reads_ahead_across_tensors(
    through: str, nginx: Nginx, served: tuple[Path, str], mount: MountFn
) -> None:
    local, url = served
    mnt = mount(url)
    nginx.log.clear()
    if through == "tensors":
        paths = [tensor_path(mnt, f"layers.{i}.weight") for i in range(TENSORS)]
        result = subprocess.run(["cat", *paths], capture_output=True, timeout=60)
        assert result.stdout == b"".join(tensor_bytes(str(local), f"layers.{i}.weight") for i in range(TENSORS))
    else:
        assert read_cold(os.path.join(mnt, "files", "m.safetensors")) == local.read_bytes()
    bounds = spans(local)
    ranges = fetched_ranges(nginx, "m.safetensors")
    assert sum(hi - lo for lo, hi in ranges) <= 1.1 * (bounds[-1][1] - bounds[0][0])
    # one fetch per block, whole blocks from the start on: each holds a boundary (blocks are longer than a tensor),
    # as no per-tensor fetch can
    whole_blocks = bounds[-1][1] // DEFAULT_BLOCK_SIZE - 1
    assert crossing(ranges, [lo for lo, _ in bounds[1:]]) >= whole_blocks
    assert len({entry.connection for entry in nginx.log.entries()}) >= 2  # fetched in parallel


def test_the_next_tensor_is_read_on_into_when_c_answered_the_rest_of_the_one_before(
    nginx: Nginx, served: tuple[Path, str], mount: MountFn
) -> None:
    """stfs._native answers reads of blocks already fetched without Python seeing them: the reader is last seen at
    the start of the fourth tensor, then asks for the fifth. It goes on from where the fourth ends: across spans."""
    local, url = served
    mnt = mount(url)
    bounds = spans(local)
    assert bounds[3][0] // DEFAULT_BLOCK_SIZE == bounds[5][0] // DEFAULT_BLOCK_SIZE == 1  # 3, 4, most of 5 in block 1
    third, fourth = sorted(named_spans(local), key=named_spans(local).get)[3:5]  # in file order
    expected = tensor_bytes(str(local), third)
    assert read_cold(tensor_path(mnt, third), 0, 4096) == expected[:4096]  # fetches its part of block 1: all of it
    assert read_cold(tensor_path(mnt, third), 4096) == expected[4096:]  # C's, where it is built
    nginx.log.clear()
    assert read_cold(tensor_path(mnt, fourth)) == tensor_bytes(str(local), fourth)
    ranges = fetched_ranges(nginx, "m.safetensors")
    # before: a new reader, its fetches clipped to the fifth tensor
    assert crossing(ranges, [bounds[5][0]]) >= 1, [(lo / MIB, hi / MIB) for lo, hi in ranges]


def test_a_jump_to_one_tensor_through_files_fetches_only_around_it(
    nginx: Nginx, served: tuple[Path, str], mount: MountFn
) -> None:
    """What safe_open does: the header by read(), then the tensor through an mmap."""
    local, url = served
    mnt = mount(url)
    nginx.log.clear()
    bounds = spans(local)
    lo, hi = bounds[7]
    with open(os.path.join(mnt, "files", "m.safetensors"), "rb") as stream:
        length = int.from_bytes(stream.read(8), "little")
        json.loads(stream.read(length))
        with mmap.mmap(stream.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            got = mapped[lo:hi]
    assert got == local.read_bytes()[lo:hi], "not the tensor's bytes"  # (no diff of 3 MiB on failure)
    fetched = sum(b - a for a, b in fetched_ranges(nginx, "m.safetensors"))
    # the tensor, the header, and the kernel's own readahead around the faults (max_read either side), never
    # the tensors after it (it was 21x the tensor before: the read at offset 0 counted as sequential)
    assert fetched <= (hi - lo) + 8 + length + 3 * MIB, fetched / (hi - lo)


@pytest.mark.parametrize("native", ["1", "0"], ids=["C", "Python"])
def test_safe_open_of_one_tensor_through_files_fetches_at_most_a_tenth_more(
    native: str, nginx: Nginx, served: tuple[Path, str], mount: MountFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the default options: ``files/m.safetensors`` is opened with a readahead of its own (readahead.py, 128 KiB
    for these 3 MiB tensors), so the read-around of safe_open's mmap faults stays within a tenth of the tensor and
    the header (1.7x with the mount's 1008 KiB window)."""
    monkeypatch.setenv("STFS_NATIVE", native)
    assert _safe_open_jump(nginx, served, mount, 7) <= 1.1


def test_a_jump_to_a_tensor_near_the_header_is_not_a_sequential_reader(
    nginx: Nginx, served: tuple[Path, str], mount: MountFn
) -> None:
    """safe_open reads the header, then faults in a tensor a few MiB on (here the third, 6 MiB in): a new jump, not
    the header's reader going on (8x the tensor was fetched when the gap counted as read, within 16 MiB)."""
    assert _safe_open_jump(nginx, served, mount, 2) <= 1.1


def _safe_open_jump(nginx: Nginx, served: tuple[Path, str], mount: MountFn, index: int) -> float:
    """Bytes fetched ÷ (tensor + header) for ``safe_open(MNT/files/m.safetensors).get_tensor`` of the ``index``-th
    tensor in file order, on a fresh mount (its bytes checked)."""
    safetensors = pytest.importorskip("safetensors")
    local, url = served
    mnt = mount(url)
    nginx.log.clear()
    bounds = spans(local)
    lo, hi = bounds[index]
    name = next(n for n, span in named_spans(local).items() if span == (lo, hi))
    with safetensors.safe_open(os.path.join(mnt, "files", "m.safetensors"), "numpy") as opened:
        assert opened.get_tensor(name).tobytes() == local.read_bytes()[lo:hi], "not the tensor's bytes"
    fetched = sum(b - a for a, b in fetched_ranges(nginx, "m.safetensors"))
    return fetched / ((hi - lo) + bounds[0][0])


@pytest.mark.parametrize("native", ["1", "0"], ids=["C", "Python"])
def test_a_tensor_opened_after_files_reads_at_the_mounts_whole_window(
    native: str, nginx: Nginx, served: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The small window is ``files/``'s alone: a ``tensors/`` file opened after it reaches the daemon in requests of
    ``max_read`` (a cold sequential read, counted by STFS_STATS), and ``files/`` opened again in 128 KiB ones."""
    monkeypatch.setenv("STFS_NATIVE", native)
    stats = tmp_path / "stats.json"
    monkeypatch.setenv("STFS_STATS", str(stats))
    local, url = served
    (tmp_path / "mnt").mkdir()
    with mounted(url, str(tmp_path / "mnt")) as mnt:
        _wait_for_the_mounts_window(mnt)
        with open(os.path.join(mnt, "files", "m.safetensors"), "rb") as stream:
            assert stream.read(8) == local.read_bytes()[:8]
        tensor = tensor_path(mnt, "layers.5.weight")
        assert read_cold(tensor) == tensor_bytes(str(local), "layers.5.weight")
        largest = max(int(size) for size in json.loads(_snapshot(stats))["read_sizes"])
        assert largest >= 1008 * 1024, json.loads(_snapshot(stats))["read_sizes"]
        before = json.loads(_snapshot(stats))["read_sizes"]
        whole = local.read_bytes()
        assert read_cold(os.path.join(mnt, "files", "m.safetensors"), 5 * MIB, 4 * MIB) == whole[5 * MIB : 9 * MIB]
        after = json.loads(_snapshot(stats))["read_sizes"]
        new = {int(size) for size, count in after.items() if count > before.get(size, 0)}
        assert new and max(new) <= 128 * 1024, after


def _wait_for_the_mounts_window(mnt: str) -> None:
    """``mounted`` returns once the mount appears; the daemon raises its readahead a moment later (after INIT), and
    a file opened before that keeps the kernel's 128 KiB."""
    device = os.stat(mnt).st_dev
    setting = Path(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb")
    deadline = time.monotonic() + 10
    while int(setting.read_text()) < 1000:
        assert time.monotonic() < deadline, "the daemon did not raise the mount's readahead"
        time.sleep(0.02)


def _snapshot(stats: Path) -> str:
    """The daemon's counters now: it writes them on SIGUSR1 (stfs/stats.py)."""
    pid = daemon_pid(str(stats.parent / "mnt"))
    assert pid
    stats.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while not stats.exists() or not stats.read_text().endswith("}"):
        assert time.monotonic() < deadline, "the daemon wrote no counters"
        time.sleep(0.05)
    return stats.read_text()


def test_the_block_cache_under_eviction_with_concurrent_readers(
    nginx: Nginx, served: tuple[Path, str], mount: MountFn
) -> None:
    """A cache of 4 MiB (16 slots of 256 KiB) for a 36 MiB model: sequential readers of tensors/ and files/ and
    random readers at once, every byte right; memory within the bound."""
    local, url = served
    mnt = mount(url, options=["cache_size=4M"])
    pid = daemon_pid(mnt)
    assert pid
    whole = local.read_bytes()
    tensors = [tensor_bytes(str(local), f"layers.{i}.weight") for i in range(TENSORS)]

    def reader(number: int) -> int:
        if number == 0:
            assert read_cold(os.path.join(mnt, "files", "m.safetensors")) == whole
        elif number % 2:
            for i in range(number % TENSORS, TENSORS):
                assert read_cold(tensor_path(mnt, f"layers.{i}.weight")) == tensors[i]
        else:
            for step in range(40):
                i = (number * 7 + step * 5) % TENSORS
                offset = (step * 977_777 + number * 4099) % (SIZE - MIB)
                got = read_cold(tensor_path(mnt, f"layers.{i}.weight"), offset, 300_000)
                assert got == tensors[i][offset : offset + 300_000]
        return number

    with ThreadPoolExecutor(6) as pool:
        assert sorted(pool.map(reader, range(6))) == list(range(6))
    assert rss_memory(pid) < (4 + 150) * MIB


def test_the_jump_window_is_a_32nd_of_the_tensor_holding_the_median_byte() -> None:
    assert jump_window_kb([4 * MIB] * 32) == 128  # the benchmark's jump case: 32 tensors of 4 MiB
    assert jump_window_kb([8 * MIB] * 4) == 256
    assert jump_window_kb([8 * MIB, 100 * MIB]) == 3200  # the median byte is in the big one
    assert jump_window_kb([4096] * 1000 + [64 * MIB]) == 2048  # a thousand norms do not make it small
    assert jump_window_kb([SIZE] * TENSORS) == 128  # never under the kernel's own 128 KiB
    assert jump_window_kb([0, 0]) == jump_window_kb([]) == 128
    assert jump_window_kb([4 * MIB + 5000]) == 128  # in whole pages, rounded down


def test_only_the_shards_of_files_get_a_window_of_their_own(tmp_path: Path) -> None:
    """``files/`` of a remote folder: each shard by its own tensors, the index and config.json at the mount's window;
    of a local one, every file at the mount's window."""
    index = write_sharded(
        str(tmp_path / "repo"),
        {
            "a.safetensors": {"x": np.zeros(8 * MIB // 4, np.float32), "y": np.zeros(4, np.float32)},
            "b.safetensors": {"z": np.zeros(16 * MIB, np.uint8)},
        },
    )
    (tmp_path / "repo" / "config.json").write_text("{}")
    source = LocalFiles()
    try:
        folder = os.path.dirname(index)
        models = resolve(folder, source)
        tree = build_tree(models, files=source_files(folder, source, models), jump_windows=True)
        local_tree = build_tree(models, files=source_files(folder, source, models))
    finally:
        source.close()
    windows = {path: tree.readahead_kb.get(tree.lookup(path).inode, 0) for path in _files(tree)}  # type: ignore[union-attr]
    assert windows == {
        "/files/a.safetensors": 256,
        "/files/b.safetensors": 512,
        "/files/config.json": 0,
        "/files/model.safetensors.index.json": 0,
    }
    assert local_tree.readahead_kb == {}  # a local source's read-around costs no request: the mount's window


def _files(tree: Tree) -> list[str]:
    folder = tree.lookup("/files")
    assert isinstance(folder, DirNode)
    return [f"/files/{name}" for name in folder.children]


@pytest.mark.parametrize(
    ("cache", "chunk"), [(8 * MIB, 3 * MIB), (8 * MIB, 2 * MIB + 12345), (2 * MIB, 1 * MIB), (4 * MIB, 3 * MIB)]
)
def test_reads_of_many_blocks_fetch_each_byte_once(nginx: Nginx, cache: int, chunk: int) -> None:
    """``check --values``, ``diff``, a blob's digest and a compressed layer's pass read a remote file in chunks of
    several blocks (256 KiB with a cache this small): the blocks a read spans stay its own until it has them. They
    were passed by as soon as it began, and its fetches ahead took their slots first (1.17-1.4x the file came over
    the wire); and where the cache has too few slots for the read's blocks, those kept behind it and the window,
    the window is cut to fit (1.3-1.44x)."""
    from stfs.sources import open_source

    data = np.random.default_rng(5).integers(0, 256, 24 * MIB, dtype=np.uint8).tobytes()
    (nginx.root / "chunks.bin").write_bytes(data)
    source, key = open_source(f"{nginx.url}/chunks.bin", keep_source_cache=True, cache_size=cache)
    try:
        read = bytearray()
        buffer = memoryview(bytearray(chunk))
        while len(read) < len(data):
            got = source.read_into(key, len(read), buffer[: min(chunk, len(data) - len(read))])
            assert got > 0
            read += buffer[:got]
        assert read == data
        assert source.transfer()["bytes"] == len(data)  # type: ignore[attr-defined]
    finally:
        source.close()
