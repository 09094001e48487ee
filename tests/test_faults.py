"""Faults under load: sources truncated, rewritten, replaced or deleted under readers; the daemon killed.

The rule every test holds: a read returns the mounted bytes or fails (EIO, or ENOTCONN once the daemon is gone);
it never returns other bytes as the tensor's, never hangs, and the daemon survives anything done to its sources.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from stfs.daemon import daemon_pid, is_dead_mount
from stfs.model import read_header
from stfs.sources import LocalFiles, SourceChanged
from tests.helpers import MountFn
from tests.models import sharded_arrays, write_numpy, write_sharded

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20


def tensor_source(path: str) -> tuple[str, int]:
    """(source file, absolute offset) of a mounted tensor file, from its xattrs."""
    return os.getxattr(path, "user.safetensors.file").decode(), int(os.getxattr(path, "user.safetensors.offset"))


def drop_cache(path: str) -> None:
    """Drop the mount's cached pages of ``path`` (kernel_cache keeps them), so the next read asks the daemon."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_at(path: str, offset: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


@dataclass
class Outcomes:
    ok: int = 0
    failed: dict[int, int] = field(default_factory=dict)  # errno -> count
    wrong: list[str] = field(default_factory=list)


class Hammer:
    """Threads reading random ranges of one mounted file (cache dropped first), each read checked against
    ``original``: a read must return exactly the original bytes or fail with an errno in ``allowed``."""

    def __init__(self, path: str, original: bytes, threads: int = 4, allowed: tuple[int, ...] = (errno.EIO,)) -> None:
        self.path = path
        self.original = original
        self.allowed = allowed
        self.stop = threading.Event()
        self.count = 0
        self.lock = threading.Lock()
        self.outcomes = Outcomes()
        self.threads = [threading.Thread(target=self._run, args=(seed,), daemon=True) for seed in range(threads)]

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            while not self.stop.is_set():
                offset = rng.randrange(0, len(self.original))
                size = rng.choice([1, 4096, 65536, 300_000])
                if rng.random() < 0.5:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                try:
                    data = os.pread(fd, size, offset)
                except OSError as exc:
                    self._record(error=exc.errno)
                    continue
                expected = self.original[offset : offset + size]
                # a short read is fine when what it returns is right (the kernel stops at a failed page)
                right = data == expected[: len(data)] and (data or offset >= len(self.original) or not expected)
                self._record(wrong=None if right else f"{len(data)} bytes at {offset} are not the original")
        finally:
            os.close(fd)

    def _record(self, error: int | None = None, wrong: str | None = None) -> None:
        with self.lock:
            self.count += 1
            if wrong is not None:
                self.outcomes.wrong.append(wrong)
            elif error is not None:
                self.outcomes.failed[error] = self.outcomes.failed.get(error, 0) + 1
            else:
                self.outcomes.ok += 1

    def wait_reads(self, more: int) -> None:
        """Block until ``more`` further reads are done (a count, never a time)."""
        target = self.count + more
        while self.count < target and any(t.is_alive() for t in self.threads):
            time.sleep(0.01)

    def __enter__(self) -> Hammer:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)
        assert not any(t.is_alive() for t in self.threads), "a reader hung"

    def check(self) -> None:
        assert self.outcomes.wrong == [], self.outcomes.wrong[:5]
        unexpected = {errno.errorcode.get(e, e): n for e, n in self.outcomes.failed.items() if e not in self.allowed}
        assert unexpected == {}, f"reads failed with {unexpected}"


@pytest.fixture
def model(tmp_path: os.PathLike) -> str:
    """One file: 'big' 4 MiB of random bytes, then 'tail' 1 MiB (offset not page-aligned in the source)."""
    rng = np.random.default_rng(5)
    arrays = {
        "big": rng.integers(0, 256, 4 * MIB, dtype=np.uint8),
        "tail": rng.integers(0, 256, MIB, dtype=np.uint8),
        "small": np.arange(10, dtype=np.int16),
    }
    return write_numpy(os.path.join(str(tmp_path), "m.safetensors"), arrays, metadata={"v": "1"})


def _original(mnt: str, name: str) -> bytes:
    source, offset = tensor_source(os.path.join(mnt, "tensors", name))
    size = os.path.getsize(os.path.join(mnt, "tensors", name))
    with open(source, "rb") as stream:
        stream.seek(offset)
        return stream.read(size)


def _rewritten(path: str) -> None:
    """Rewrite ``path`` in place (same inode) as a different model: new header, inverted bytes everywhere."""
    rng = np.random.default_rng(99)
    tmp = path + ".new"
    write_numpy(
        tmp,
        {
            "big": rng.integers(0, 256, 4 * MIB, dtype=np.uint8),
            "tail": rng.integers(0, 256, MIB, dtype=np.uint8),
            "small": np.arange(10, dtype=np.int16) + 1,
        },
        metadata={"v": "2, rewritten"},
    )
    with open(tmp, "rb") as stream:
        data = stream.read()
    os.unlink(tmp)
    with open(path, "r+b") as stream:  # like a writer with O_TRUNC: header first, then data
        stream.truncate(0)
        stream.write(data)


def test_truncated_source_gives_eio_or_old_bytes(mount: MountFn, model: str) -> None:
    mnt = mount(model)
    big = os.path.join(mnt, "tensors", "big")
    original = _original(mnt, "big")
    source, offset = tensor_source(big)
    cut = 2 * MIB  # in the tensor's coordinates: page-aligned in the mounted file
    with Hammer(big, original) as hammer:
        hammer.wait_reads(200)
        os.truncate(source, offset + cut)
        hammer.wait_reads(400)
    hammer.check()
    assert hammer.outcomes.ok > 0 and hammer.outcomes.failed.get(errno.EIO, 0) > 0

    for position in range(0, cut, 256 * 1024):  # before the new end too: the mounted version is gone
        drop_cache(big)
        with pytest.raises(OSError) as caught:
            read_at(big, position, 4096)
        assert caught.value.errno == errno.EIO
    for position in (cut, cut + 4096, len(original) - 1):
        drop_cache(big)
        with pytest.raises(OSError) as caught:
            read_at(big, position, 4096)
        assert caught.value.errno == errno.EIO
    drop_cache(os.path.join(mnt, "tensors", "tail"))
    with pytest.raises(OSError) as caught:
        read_at(os.path.join(mnt, "tensors", "tail"), 0, 10)
    assert caught.value.errno == errno.EIO
    # the daemon is alive and the rest of the mount still serves
    assert os.path.ismount(mnt)
    assert sorted(os.listdir(os.path.join(mnt, "tensors"))) == ["big", "small", "tail"]
    with open(os.path.join(mnt, "metadata", "v"), "rb") as stream:  # held in memory since validation
        assert stream.read() == b"1\n"
    drop_cache(os.path.join(mnt, "header.json"))
    with pytest.raises(OSError) as caught:  # a range of the changed source, like its tensors
        read_at(os.path.join(mnt, "header.json"), 0, 100)
    assert caught.value.errno == errno.EIO


def test_source_rewritten_in_place_with_another_header(mount: MountFn, model: str) -> None:
    mnt = mount(model)
    big = os.path.join(mnt, "tensors", "big")
    original = _original(mnt, "big")
    with Hammer(big, original) as hammer:
        hammer.wait_reads(200)
        _rewritten(tensor_source(big)[0])
        hammer.wait_reads(400)
    hammer.check()  # EIO or the old bytes, never the new ones
    assert hammer.outcomes.failed.get(errno.EIO, 0) > 0
    for name in ("big", "tail", "small"):
        path = os.path.join(mnt, "tensors", name)
        drop_cache(path)
        with pytest.raises(OSError) as caught:
            read_at(path, 0, 4096)
        assert caught.value.errno == errno.EIO
    assert os.path.ismount(mnt)
    assert os.getxattr(big, "user.safetensors.dtype") == b"U8"


@pytest.mark.parametrize("how", ["rename", "delete"])
def test_source_replaced_or_deleted_keeps_old_bytes_or_eio(mount: MountFn, model: str, how: str) -> None:
    mnt = mount(model)
    big = os.path.join(mnt, "tensors", "big")
    originals = {name: _original(mnt, name) for name in ("big", "tail")}
    source = tensor_source(big)[0]
    with Hammer(big, originals["big"]) as hammer:
        hammer.wait_reads(200)
        if how == "rename":
            replacement = source + ".tmp"
            with open(source, "rb") as stream, open(replacement, "wb") as copy:
                copy.write(stream.read())
            _rewritten(replacement)
            os.replace(replacement, source)
        else:
            os.unlink(source)
        hammer.wait_reads(400)
    hammer.check()
    # the daemon still holds the old file open: its bytes, or EIO, never the replacement's
    for name, original in originals.items():
        path = os.path.join(mnt, "tensors", name)
        drop_cache(path)
        try:
            data = read_at(path, 0, len(original))
        except OSError as exc:
            assert exc.errno == errno.EIO
        else:
            assert data == original
    assert os.path.ismount(mnt)


def test_a_shard_never_read_before_deletion_still_serves(mount: MountFn, tmp_path: os.PathLike) -> None:
    arrays = sharded_arrays()
    index = write_sharded(os.path.join(str(tmp_path), "set"), arrays)
    mnt = mount(index)
    first = os.path.join(mnt, "tensors", "model", "embed_tokens", "weight")
    second = os.path.join(mnt, "tensors", "lm_head", "weight")
    before = read_at(first, 0, 1 << 20)
    for name in os.listdir(os.path.dirname(index)):
        if name.endswith(".safetensors"):
            os.unlink(os.path.join(os.path.dirname(index), name))
    drop_cache(first)
    assert read_at(first, 0, 1 << 20) == before  # its descriptor is still open in the daemon
    # held open since it was validated, though never read through the mount
    assert read_at(second, 0, 1 << 20) == arrays["model-00002-of-00002.safetensors"]["lm_head.weight"].tobytes()
    assert os.path.ismount(mnt)


# -- the read path itself, without FUSE: races made deterministic -------------------------------------------------


def _local_files(path: str) -> tuple[LocalFiles, int]:
    files = LocalFiles()
    return files, read_header(path, files).data_start  # validated through the source: pinned


def test_a_rewrite_landing_during_a_read_fails_that_read(
    tmp_path: os.PathLike, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check before a read cannot see a rewrite that lands between it and the pread; the check after can."""
    path = write_numpy(os.path.join(str(tmp_path), "m.safetensors"), {"w": np.zeros(4096, np.uint8)})
    files, data_start = _local_files(path)
    buffer = bytearray(64)
    assert files.read_into(path, data_start, memoryview(buffer)) == 64
    real_preadv = os.preadv

    def rewrite_then_read(fd: int, buffers: list[memoryview], position: int) -> int:
        monkeypatch.setattr(os, "preadv", real_preadv)
        replacement = os.path.join(str(tmp_path), "new.safetensors")
        write_numpy(replacement, {"w": np.full(4096, 7, np.uint8)}, metadata={"rewritten": "yes"})
        with open(replacement, "rb") as source, open(path, "r+b") as target:  # same inode, header first
            target.truncate(0)
            target.write(source.read())
        return real_preadv(fd, buffers, position)

    monkeypatch.setattr(os, "preadv", rewrite_then_read)
    with pytest.raises(SourceChanged):
        files.read_into(path, data_start, memoryview(buffer))
    with pytest.raises(SourceChanged):  # and every read after it
        files.read_into(path, data_start, memoryview(buffer))
    files.close()


def test_a_failed_reopen_does_not_leak_the_descriptor(tmp_path: os.PathLike, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [write_numpy(os.path.join(str(tmp_path), f"{n}.safetensors"), {"w": np.zeros(16, np.uint8)}) for n in "ab"]
    files = LocalFiles(max_open=1)  # one descriptor: reading a, then b, then a again reopens a
    starts = [read_header(path, files).data_start for path in paths]
    assert files.read_into(paths[1], starts[1], memoryview(bytearray(4))) == 4
    before = len(os.listdir("/proc/self/fd"))

    def failing_fstat(*args: object) -> os.stat_result:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "fstat", failing_fstat)
    for _ in range(5):
        with pytest.raises(OSError):
            files.read_into(paths[0], starts[0], memoryview(bytearray(4)))
    assert len(os.listdir("/proc/self/fd")) == before
    monkeypatch.undo()
    assert files.read_into(paths[0], starts[0], memoryview(bytearray(4))) == 4
    files.close()


# -- the daemon killed under readers -----------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stream:
            return stream.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + 30  # a bound against hangs, not a performance claim
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


@contextlib.contextmanager
def background_mount(source: str, mountpoint: str, *options: str) -> Iterator[int]:
    """``stfs mount`` (the forking daemon) for the block; yields the daemon's PID; always unmounts after it."""
    os.makedirs(mountpoint, exist_ok=True)
    command = [sys.executable, "-m", "stfs", "mount", source, mountpoint, *options]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    pid = daemon_pid(mountpoint)
    assert pid is not None
    try:
        yield pid
    finally:
        unmount_for_good(mountpoint)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)  # only our own daemon, by PID
            wait_gone(pid)


def unmount_for_good(mountpoint: str) -> None:
    for lazy in ([], ["--lazy"]):
        if os.path.ismount(mountpoint) or is_dead_mount(mountpoint):
            subprocess.run(
                [sys.executable, "-m", "stfs", "unmount", *lazy, mountpoint], capture_output=True, timeout=60
            )


READER = textwrap.dedent("""
    import errno, os, random, sys
    path, size = sys.argv[1], int(sys.argv[2])
    fd = os.open(path, os.O_RDONLY)
    rng = random.Random(os.getpid())
    reads = 0
    while True:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            os.pread(fd, 65536, rng.randrange(0, size))
        except OSError as exc:
            print("error", errno.errorcode.get(exc.errno, exc.errno), flush=True)
            sys.exit(0)
        reads += 1
        if reads == 20:
            print("reading", flush=True)
""")


def _start_readers(path: str, count: int) -> list[subprocess.Popen]:
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", READER, path, str(os.path.getsize(path))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    for reader in readers:
        assert reader.stdout is not None
        line = reader.stdout.readline().strip()
        assert line == "reading", (line, reader.stderr.read() if reader.poll() is not None else "")
    return readers


def _finish_readers(readers: list[subprocess.Popen]) -> list[str]:
    """Each reader's last word; a reader still reading after the bound is a hang (it is killed, the test fails)."""
    words = []
    for reader in readers:
        try:
            out, _ = reader.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            reader.kill()
            reader.communicate()
            words.append("hung")
            continue
        words.append(out.strip())
    return words


@pytest.fixture
def big_model(tmp_path: os.PathLike) -> str:
    rng = np.random.default_rng(11)
    return write_numpy(
        os.path.join(str(tmp_path), "big.safetensors"),
        {"w": rng.integers(0, 256, 8 * MIB, dtype=np.uint8), "b": np.arange(100, dtype=np.float32)},
    )


def _remount_works(source: str, mountpoint: str) -> None:
    with background_mount(source, mountpoint):
        path = os.path.join(mountpoint, "tensors", "b")
        assert np.array_equal(np.fromfile(path, dtype=np.float32), np.arange(100, dtype=np.float32))


def test_sigkill_during_reads_fails_readers_and_unmount_recovers(
    big_model: str, tmp_path: os.PathLike, require_fuse: None
) -> None:
    mountpoint = os.path.join(str(tmp_path), "mnt")
    with background_mount(big_model, mountpoint) as pid:
        readers = _start_readers(os.path.join(mountpoint, "tensors", "w"), 4)
        os.kill(pid, signal.SIGKILL)
        words = _finish_readers(readers)
        assert words == ["error ENOTCONN"] * 4
        assert wait_gone(pid)
        assert is_dead_mount(mountpoint)
        # a mount on a dead endpoint is refused with advice
        again = subprocess.run(
            [sys.executable, "-m", "stfs", "mount", big_model, mountpoint], capture_output=True, text=True, timeout=60
        )
        assert again.returncode == 1 and "stfs unmount" in again.stderr
        result = subprocess.run(
            [sys.executable, "-m", "stfs", "unmount", mountpoint], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert not os.path.ismount(mountpoint) and not is_dead_mount(mountpoint)
    _remount_works(big_model, mountpoint)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_during_reads_unmounts_cleanly(
    big_model: str, tmp_path: os.PathLike, require_fuse: None, signum: int
) -> None:
    mountpoint = os.path.join(str(tmp_path), "mnt")
    with background_mount(big_model, mountpoint) as pid:
        readers = _start_readers(os.path.join(mountpoint, "tensors", "w"), 4)
        os.kill(pid, signum)
        assert wait_gone(pid), "the daemon did not exit"
        words = _finish_readers(readers)
        assert "hung" not in words
        assert all(word.startswith("error") for word in words), words
        assert not os.path.ismount(mountpoint) and not is_dead_mount(mountpoint)
    _remount_works(big_model, mountpoint)


def sparse_model(path: str, size: int) -> str:
    """One F32 tensor of ``size`` bytes of zeros, a hole in the file: gigabytes at no cost of disk or time."""
    header = json.dumps({"t": {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(header)) + header)
        stream.truncate(8 + len(header) + size)
    return path


def bytes_read(pid: int) -> int:
    with open(f"/proc/{pid}/io") as stream:
        return int(next(line for line in stream if line.startswith("rchar:")).split()[1])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_gives_up_a_summary_being_made(tmp_path: os.PathLike, require_fuse: None, signum: int) -> None:
    """SIGTERM or SIGINT while ``stats/`` of a 16 GiB tensor is being made (many seconds of work): the daemon gives
    the summary up at its next chunk and exits; the reader gets an error and the log says why."""
    source = sparse_model(os.path.join(str(tmp_path), "big.safetensors"), 16 << 30)
    mountpoint = os.path.join(str(tmp_path), "mnt")
    log = os.path.join(str(tmp_path), "stfs.log")
    with background_mount(source, mountpoint, "--view", "stats", "--log-file", log) as pid:
        reader = subprocess.Popen(
            ["cat", os.path.join(mountpoint, "stats", "t.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            deadline = time.monotonic() + 30
            while bytes_read(pid) < 64 * MIB and time.monotonic() < deadline:  # the summary is under way
                time.sleep(0.01)
            os.kill(pid, signum)
            assert wait_gone(pid), "the daemon went on making the summary"
            out, _ = reader.communicate(timeout=30)
        finally:
            if reader.poll() is None:
                if _alive(pid):  # first: a read the daemon holds cannot be killed
                    os.kill(pid, signal.SIGKILL)  # our own daemon, by PID
                reader.kill()
                reader.wait()
        assert reader.returncode != 0 and out == b""
    with open(log) as stream:
        assert "given up, the mount is stopping" in stream.read()


def test_eight_threads_fault_one_mapping_of_a_large_tensor(mount: MountFn, tmp_path: os.PathLike) -> None:
    count = 32 * MIB  # 128 MiB of uint32
    source = os.path.join(str(tmp_path), "large.safetensors")
    try:
        write_numpy(source, {"head": np.arange(3, dtype=np.int8), "w": np.arange(count, dtype=np.uint32)})
        mnt = mount(source)
        path = os.path.join(mnt, "tensors", "w")
        chunk = MIB
        expected = np.arange(count, dtype=np.uint32).view(np.uint8)
        want = [hashlib.blake2b(expected[i : i + chunk]).digest() for i in range(0, len(expected), chunk)]
        del expected
        failures: list[str] = []
        with open(path, "rb") as stream, mmap.mmap(stream.fileno(), 0, prot=mmap.PROT_READ) as mapping:
            view = memoryview(mapping)

            def fault(start: int) -> None:
                order = [(start + step) % len(want) for step in range(len(want))]
                for index in order:
                    # hashlib drops the GIL for big buffers: the eight threads fault pages at once
                    if hashlib.blake2b(view[index * chunk : (index + 1) * chunk]).digest() != want[index]:
                        failures.append(f"chunk {index}")

            threads = [threading.Thread(target=fault, args=(i * len(want) // 8,)) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=100)
            assert not any(t.is_alive() for t in threads)
            view.release()
        assert failures == []
    finally:
        with contextlib.suppress(OSError):
            os.unlink(source)
