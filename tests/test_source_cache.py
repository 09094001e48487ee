"""LocalFiles drops the source pages it has served (each page in RAM once), in order or not, and keeps them if asked."""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import struct
import subprocess
import termios

import pytest

from stfs.sources import LocalFiles

MIB = 1 << 20
SIZE = 48 * MIB
OFFSET = 1000  # like a tensor: not page-aligned

pytestmark = pytest.mark.skipif(shutil.which("fincore") is None, reason="fincore (util-linux) is not installed")


def resident(path: str) -> int:
    result = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", path], capture_output=True, text=True, check=True
    )
    return int(result.stdout.split()[0])


@pytest.fixture
def source(tmp_path) -> str:  # noqa: ANN001
    path = str(tmp_path / "source.bin")
    with open(path, "wb") as stream:
        stream.write(random.Random(0).randbytes(OFFSET + SIZE + 4096))
        stream.flush()
        os.fsync(stream.fileno())
    return path


def drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def requests(size: int, shuffle: bool) -> list[tuple[int, int]]:
    """1008 KiB requests covering SIZE bytes; shuffled within windows of four, as a thread pool finishes them."""
    step = 1008 * 1024
    chunks = [(start, min(step, size - start)) for start in range(0, size, step)]
    if shuffle:
        rng = random.Random(1)
        for low in range(0, len(chunks), 4):
            window = chunks[low : low + 4]
            rng.shuffle(window)
            chunks[low : low + 4] = window
    return chunks


def serve(files: LocalFiles, path: str, chunks: list[tuple[int, int]], splice: bool) -> None:
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, MIB)  # as the daemon's: room for a 1008 KiB request
    try:
        for start, count in chunks:
            if splice:
                assert files.splice_into(path, OFFSET + start, count, write_end) == count
                while os.read(read_end, 1 << 20):  # what libfuse does with the pipe, roughly
                    if not _pending(read_end):
                        break
            else:
                buffer = bytearray(count)
                assert files.read_into(path, OFFSET + start, memoryview(buffer)) == count
    finally:
        os.close(read_end)
        os.close(write_end)


def _pending(fd: int) -> bool:
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0] > 0


@pytest.mark.parametrize(
    ("splice", "threaded", "shuffle"),
    [(True, False, False), (False, False, False), (True, True, True), (False, True, True)],
)
def test_served_pages_leave_the_source_cache(source: str, splice: bool, threaded: bool, shuffle: bool) -> None:
    files = LocalFiles(threaded=threaded)
    serve(files, source, requests(SIZE, shuffle), splice)
    files.close()  # what is left of the runs goes when the descriptor is closed
    assert resident(source) <= 4 * 4096, resident(source)


def test_served_pages_go_behind_the_reader(source: str) -> None:
    # Half the file read, descriptor still open. What stays cached is the drop lag, the current chunk and
    # the kernel's readahead past the reader (8 MiB on this kind of disk); kept, the whole half stays too.
    left = {}
    for keep in (False, True):
        drop(source)
        files = LocalFiles(drop_behind=not keep, threaded=False)  # as the daemon runs by default
        serve(files, source, requests(SIZE // 2, shuffle=False), splice=True)
        left[keep] = resident(source)
        files.close()
    assert left[False] <= left[True] - SIZE // 4, left


def test_keep_source_cache(source: str) -> None:
    drop(source)
    files = LocalFiles(drop_behind=False)
    serve(files, source, requests(SIZE, shuffle=False), splice=True)
    files.close()
    assert resident(source) >= SIZE


def test_isolated_small_reads_are_left_alone(source: str) -> None:
    drop(source)
    files = LocalFiles()
    positions = random.Random(2).sample(range(0, SIZE // 4096), 200)
    for position in positions:
        buffer = bytearray(4096)
        files.read_into(source, OFFSET + position * 4096, memoryview(buffer))
    assert resident(source) >= 200 * 4096  # no syscall per random 4 KiB read: those pages stay
    files.close()
