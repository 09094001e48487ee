"""The bounded disk cache (``--cache-dir DIR --cache-dir-size SIZE``, SPEC §7): least recently used pieces go
first, across the daemons sharing DIR, never one being read; DIR stays within the bound plus one piece per
daemon; a full disk leaves the daemon serving from memory with one log line; a bad size is a usage error."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stfs.sources.disk_cache import USAGE_FILE, DiskCache, covering, gaps
from stfs.sources.remote import DEFAULT_BLOCK_SIZE
from tests.helpers import MountFn, read_cold, run, tensor_path
from tests.models import tensor_bytes
from tests.remote_helpers import MIB, big_model
from tests.servers import Nginx

pytestmark = pytest.mark.timeout(120)

KIB = 1024


def folder_bytes(folder: Path) -> int:
    """What the folder holds in files (pieces, pieces being written), the usage file aside."""
    total = 0
    for parent, _, files in os.walk(folder):  # folders that go away mid-walk are skipped
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                if name != USAGE_FILE:
                    total += os.stat(os.path.join(parent, name)).st_size
    return total


def piece(n: int, size: int = 100 * KIB) -> bytes:
    return bytes([n % 256]) * size


def test_least_recently_used_pieces_go_first(tmp_path: Path) -> None:
    cache = DiskCache(str(tmp_path / "c"), max_bytes=350 * KIB)
    for n in range(3):
        cache.put("k", "v1", n * 100 * KIB, (n + 1) * 100 * KIB, piece(n))
    assert cache.get("k", "v1", 0, 100 * KIB) == piece(0)  # piece 0 is now the most recently used
    cache.put("k", "v1", 300 * KIB, 400 * KIB, piece(3))  # 400 KiB > 350: one piece must go, piece 1
    assert cache.get("k", "v1", 100 * KIB, 200 * KIB) is None
    for n in (0, 2, 3):
        assert cache.get("k", "v1", n * 100 * KIB, (n + 1) * 100 * KIB) == piece(n), n
    assert cache.usage() == folder_bytes(tmp_path / "c") == 300 * KIB


def test_a_piece_being_read_is_never_deleted(tmp_path: Path) -> None:
    cache = DiskCache(str(tmp_path / "c"), max_bytes=250 * KIB)
    cache.put("k", "v1", 0, 100 * KIB, piece(0))
    [path] = [p for p in (tmp_path / "c").rglob("0-*")]
    with open(path, "rb") as reader:  # another daemon in the middle of reading it: its shared lock
        fcntl.flock(reader, fcntl.LOCK_SH)
        for n in range(1, 5):
            cache.put("k", "v1", n * 100 * KIB, (n + 1) * 100 * KIB, piece(n))
        assert path.exists() and reader.read() == piece(0)
    assert cache.usage() <= 250 * KIB + 100 * KIB  # the piece kept despite the bound, no more


HOLDER = """
import sys
from stfs.sources.disk_cache import DiskCache
file = DiskCache(sys.argv[1], int(sys.argv[2])).open_file(sys.argv[3])
print(len(file.read()), flush=True)
sys.stdin.read()  # held open (a mount's zstd output) until told
"""


def test_files_kept_by_name_share_the_bound_and_one_open_in_another_process_stays(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    cache = DiskCache(str(folder), max_bytes=350 * KIB)
    cache.write_file("gzip-index/a.index", piece(1))
    cache.put("k", "v1", 0, 100 * KIB, piece(2))
    cache.write_file("zstd-whole/b.tar", piece(3))
    for age, path in enumerate([folder / "zstd-whole" / "b.tar", folder / "gzip-index" / "a.index"]):
        os.utime(path, (1000 + age, 1000 + age))  # b used before a, both before the piece
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder), str(350 * KIB), "zstd-whole/b.tar"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == str(100 * KIB)
        os.utime(folder / "zstd-whole" / "b.tar", (1000, 1000))  # still the least recently used, but open
        cache.write_file("zstd-index/c.index", piece(4))  # 400 KiB: b is open, so a goes
        assert (folder / "zstd-whole" / "b.tar").read_bytes() == piece(3)
        assert not (folder / "gzip-index").exists()  # a's file and its emptied folder
        assert cache.usage() == folder_bytes(folder) == 300 * KIB
    finally:
        holder.communicate("", timeout=30)
    cache.put("k", "v1", 100 * KIB, 200 * KIB, piece(5))  # b closed: now it goes
    assert not (folder / "zstd-whole" / "b.tar").exists()
    file = cache.open_file("zstd-index/c.index")
    assert file is not None and file.read() == piece(4)
    file.close()
    cache.drop_file("zstd-index/c.index")  # found spoiled: deleted, uncounted
    assert cache.open_file("zstd-index/c.index") is None
    assert cache.usage() == folder_bytes(folder) == 200 * KIB
    cache.write_file("zstd-whole/big.tar", bytes(400 * KIB))  # larger than the bound: not kept
    assert cache.open_file("zstd-whole/big.tar") is None and cache.usage() == folder_bytes(folder) == 200 * KIB


def test_a_folder_kept_before_the_bound_existed_is_counted_and_trimmed(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    unbounded = DiskCache(str(folder), max_bytes=1 << 40)
    for n in range(10):
        unbounded.put(f"k{n}", "v", 0, 100 * KIB, piece(n))
    (folder / USAGE_FILE).unlink()  # as a cache made by an stfs without the count
    bounded = DiskCache(str(folder), max_bytes=300 * KIB)
    assert bounded.usage() == 1000 * KIB
    bounded.put("new", "v", 0, 100 * KIB, piece(99))
    assert bounded.usage() == folder_bytes(folder) <= 300 * KIB
    assert bounded.get("new", "v", 0, 100 * KIB) == piece(99)


def test_a_read_takes_what_pieces_of_any_size_cover_and_names_the_gaps(tmp_path: Path) -> None:
    data = bytes(range(256)) * 1200  # 300 KiB-odd of an object, its bytes telling where they are
    cache = DiskCache(str(tmp_path / "c"))
    cache.put("k", "v1", 0, 100 * KIB, data[: 100 * KIB])  # a tensor clipped out of a block
    cache.put("k", "v1", 150 * KIB, 300 * KIB, data[150 * KIB : 300 * KIB])
    cache.put("k", "v1", 60 * KIB, 120 * KIB, data[60 * KIB : 120 * KIB])  # overlapping another
    into = memoryview(bytearray(200 * KIB))
    filled = cache.read_into("k", "v1", 50 * KIB, into)
    assert filled == [(50 * KIB, 120 * KIB), (150 * KIB, 250 * KIB)]
    for lo, hi in filled:
        assert into[lo - 50 * KIB : hi - 50 * KIB] == data[lo:hi]
    assert gaps(50 * KIB, 250 * KIB, filled) == [(120 * KIB, 150 * KIB)]
    assert cache.get("k", "v1", 10 * KIB, 110 * KIB) == data[10 * KIB : 110 * KIB]  # across two pieces
    assert cache.get("k", "v1", 10 * KIB, 130 * KIB) is None  # not all of it
    assert cache.read_into("k", "v2", 0, memoryview(bytearray(10))) == []  # another version's pieces are not its
    before = cache.usage()
    cache.put("k", "v1", 20 * KIB, 90 * KIB, data[20 * KIB : 90 * KIB])  # covered already: not kept twice
    assert cache.usage() == before


def test_the_fewest_pieces_cover_a_range() -> None:
    pieces = [(0, 10), (2, 30), (5, 20), (25, 40), (45, 50)]
    assert covering(pieces, 0, 50) == [(0, 10, 0, 10), (2, 30, 10, 30), (25, 40, 30, 40), (45, 50, 45, 50)]
    assert covering(pieces, 41, 44) == []
    assert gaps(0, 50, [(0, 40), (45, 50)]) == [(40, 45)]
    assert gaps(0, 100, [(10, 20), (22, 30)], bridge=5) == [(0, 10), (20, 22), (30, 100)]
    assert gaps(0, 100, [(10, 20), (22, 30)], bridge=50) == [(0, 100)]  # gaps close together: one request


def test_a_piece_not_of_the_size_its_name_says_is_ignored(tmp_path: Path) -> None:
    cache = DiskCache(str(tmp_path / "c"))
    cache.put("k", "v1", 0, 100 * KIB, piece(1))
    [path] = [p for p in (tmp_path / "c").rglob("0-*")]
    os.truncate(path, 50 * KIB)  # as a disk that lost its end
    assert cache.get("k", "v1", 0, 10 * KIB) is None


WRITER = """
import sys
from stfs.sources.disk_cache import DiskCache
cache = DiskCache(sys.argv[1], max_bytes=int(sys.argv[2]))
for n in range(60):
    data = bytes([n]) * 50_000
    cache.put(f"{sys.argv[3]}-{n % 20}", "v", 0, len(data), data)
    got = cache.get(f"{sys.argv[3]}-{(n * 7) % 20}", "v", 0, len(data))
    assert got is None or got == bytes([got[0]]) * len(data)
"""


def test_processes_sharing_a_folder_keep_within_the_bound(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    bound = 400_000
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(folder), str(bound), f"p{i}"], env=env) for i in range(3)
    ]
    peak = [0]
    while any(writer.poll() is None for writer in writers):
        peak.append(folder_bytes(folder) if folder.exists() else 0)
    assert all(writer.wait() == 0 for writer in writers)
    assert max(peak) <= bound + 3 * 50_000  # the bound, plus one piece being written per process
    assert DiskCache(str(folder), bound).usage() == folder_bytes(folder) <= bound


# --- two daemons --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def sampling(folder: Path) -> Iterator[list[int]]:
    """The folder's size, sampled every 10 ms for the ``with`` block."""
    found = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            found.append(folder_bytes(folder) if folder.exists() else 0)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        done.set()
        thread.join(5)


def test_two_daemons_sharing_a_small_cache_dir(nginx: Nginx, mount: MountFn, tmp_path: Path) -> None:
    local = big_model(tmp_path / "m.safetensors", 8, 3 * MIB + 777)
    names = [f"layers.{i}.weight" for i in range(8)]
    expected = {name: tensor_bytes(str(local), name) for name in names}
    url = nginx.put("m.safetensors", local.read_bytes())
    cache = tmp_path / "cache"
    options = [f"cache_dir={cache},cache_dir_size=10M"]
    first, second = mount(url, options=options), mount(url, options=options)

    def read_all(mnt: str) -> dict[str, bytes]:
        return {name: read_cold(tensor_path(mnt, name)) for name in names}

    with sampling(cache) as sizes, ThreadPoolExecutor(2) as pool:
        for _ in range(2):
            for got in pool.map(read_all, [first, second, first]):
                assert got == expected
    # the bound, plus the one block each daemon may be writing beside it (blocks were 4 MiB when this was written)
    assert max(sizes) <= 10 * MIB + 2 * DEFAULT_BLOCK_SIZE, f"{max(sizes) / MIB:.1f} MiB"
    assert folder_bytes(cache) <= 10 * MIB
    assert folder_bytes(cache) > 0  # it was used, not skipped


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 12 MiB tmpfs: a disk that holds one 8 MiB block and fills up (needs root, as mounting tmpfs does)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder = tmp_path / "small"
    folder.mkdir()
    result = run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(folder)])
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield folder
    finally:
        run(["umount", "-l", str(folder)])


def test_a_full_disk_leaves_the_daemon_serving_from_memory(
    nginx: Nginx, small_disk: Path, tmp_path: Path, require_fuse: None
) -> None:
    local = big_model(tmp_path / "m.safetensors", 6, 3 * MIB + 99)
    url = nginx.put("m.safetensors", local.read_bytes())
    log, mnt = tmp_path / "daemon.log", tmp_path / "mnt"
    mnt.mkdir()
    command = ["mount", url, str(mnt), "--cache-dir", str(small_disk), "--cache-dir-size", "1G", "--log-file", str(log)]
    result = run([sys.executable, "-m", "stfs", *command])
    assert result.returncode == 0, result.stderr
    try:
        for _ in range(2):  # the second time round, some pieces come from the disk, the rest from the server
            for name in (f"layers.{i}.weight" for i in range(6)):
                assert read_cold(tensor_path(str(mnt), name)) == tensor_bytes(str(local), name), name
    finally:
        run([sys.executable, "-m", "stfs", "unmount", str(mnt)])
    assert log.read_text().count("is full") == 1, log.read_text()
    assert folder_bytes(small_disk) > 0


@pytest.mark.parametrize("option", [["--cache-dir-size", "10X"], ["--cache-dir-size", "0"], ["-o", "cache_dir_size=a"]])
def test_a_bad_size_is_a_usage_error(option: list[str], tmp_path: Path) -> None:
    result = run([sys.executable, "-m", "stfs", "mount", "http://127.0.0.1:1/m.safetensors", str(tmp_path), *option])
    assert result.returncode == 2, result.stderr
    assert "cache" in result.stderr and "Traceback" not in result.stderr
