"""Files as segments: bytes in memory and ranges of a source, read by one function and served by a real mount."""

from __future__ import annotations

import os
import random
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from stfs.formats.safetensors import TensorEntry
from stfs.nodes import FileNode, Range, ShardData, clamp, pieces, read_into
from stfs.sources import LocalFiles
from tests.helpers import run, served_by

SOURCE_SIZE = 400_000


@pytest.fixture
def source(tmp_path: Path) -> str:
    path = tmp_path / "source.bin"
    path.write_bytes(random.Random(3).randbytes(SOURCE_SIZE))
    return str(path)


def stitched(source: str) -> tuple[tuple[bytes | Range, ...], bytes]:
    """Segments that cross page boundaries in every way, and the bytes they stand for."""
    data = Path(source).read_bytes()
    segments = (
        b"<" * 5000,
        Range(source, 1001, 300_000),
        b">" * 3,
        Range(source, 0, 70_000),
        Range(source, 5, 0),
        b"end",
    )
    expected = b"<" * 5000 + data[1001:301_001] + b">" * 3 + data[:70_000] + b"end"
    return segments, expected


def test_pieces_cover_a_read_exactly(source: str) -> None:
    segments, expected = stitched(source)
    node = FileNode(1, 0, segments)
    assert node.size == len(expected)
    assert pieces(node, 4990, 20) == [(segments[0], 4990, 10), (segments[1], 0, 10)]
    assert pieces(node, 305_002, 10) == [(segments[2], 2, 1), (segments[3], 0, 9)]
    assert clamp(node, node.size - 2, 10) == 2 and clamp(node, node.size + 5, 10) == 0


def test_a_tensor_file_makes_its_range_from_its_shard(source: str) -> None:
    data = Path(source).read_bytes()
    shard = ShardData(source, 1000)
    tensor = TensorEntry("a.b", "U8", (5000,), 20_000, 25_000)
    node = FileNode(7, 0, shard, tensor, None, tensor.end - tensor.begin)
    (segment,) = node.segments
    assert type(segment) is Range and (segment.key, segment.offset, segment.size) == (source, 21_000, 5000)
    view = memoryview(bytearray(6000))
    assert read_into(node, 100, view, LocalFiles().read_into) == 4900
    assert bytes(view[:4900]) == data[21_100:26_000]
    with pytest.raises(AssertionError):
        FileNode(8, 0, shard, tensor)  # a file of a shard's data is given its size


def test_read_into_matches_the_bytes_anywhere(source: str) -> None:
    segments, expected = stitched(source)
    node = FileNode(1, 0, segments)
    files = LocalFiles()
    rng = random.Random(4)
    for _ in range(300):
        offset = rng.randrange(0, node.size + 10)
        buffer = bytearray(rng.choice([1, 7, 4096, 70_000, 400_000]))
        count = read_into(node, offset, memoryview(buffer), files.read_into)
        assert bytes(buffer[:count]) == expected[offset : offset + len(buffer)]
    files.close()


SERVER = textwrap.dedent("""
    import sys
    from stfs._libfuse import request_size, serve
    from stfs.fs import StfsOperations
    from stfs.model import resolve
    from stfs.nodes import Range
    from stfs.sources import LocalFiles
    from stfs.views import VIEWS, build_tree

    model, source, mountpoint = sys.argv[1:4]

    def stitched(tree, model, base, layout):  # a view: one function from a model to nodes
        segments = (b"<" * 5000, Range(source, 1001, 300_000), b">" * 3, Range(source, 0, 70_000), Range(source, 5, 0),
                    b"end")
        tree.add_file([*base, "stitched"], model.mtime_ns, segments)

    tree = build_tree(resolve(model), views=(*VIEWS, stitched))
    serve(StfsOperations(tree, LocalFiles()), mountpoint, foreground=True, ro=True, nothreads=True,
          max_read=request_size(), use_ino=True)
""")


@pytest.fixture
def stitched_mount(tmp_path: Path, source: str, require_fuse: None) -> Iterator[str]:
    """A mount served in a child process whose tree has ``/stitched``: the segments above."""
    import numpy as np
    from safetensors.numpy import save_file

    model = str(tmp_path / "m.safetensors")
    save_file({"x": np.arange(10, dtype=np.float32)}, model)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    with served_by([sys.executable, "-c", SERVER, model, source, str(mountpoint)], mountpoint, tmp_path / "server.log"):
        yield str(mountpoint)


@pytest.mark.timeout(120)
def test_a_mounted_file_of_segments_reads_exactly(stitched_mount: str, source: str, tmp_path: Path) -> None:
    _, expected = stitched(source)
    path = os.path.join(stitched_mount, "stitched")
    assert os.path.getsize(path) == len(expected)
    reference = tmp_path / "expected.bin"
    reference.write_bytes(expected)
    assert run(["cmp", path, str(reference)]).returncode == 0  # whole-file reads: requests spanning segments
    rng = random.Random(5)
    for _ in range(200):
        offset = rng.randrange(0, len(expected) + 100)
        size = rng.choice([1, 100, 4096, 9000, 65536, 131072, 300_000])
        fd = os.open(path, os.O_RDONLY)  # without kernel_cache, each open reads the daemon again
        try:
            assert os.pread(fd, size, offset) == expected[offset : offset + size], (offset, size)
        finally:
            os.close(fd)
    dd = run(["dd", f"if={path}", "bs=1M", "iflag=skip_bytes", "skip=4000", "status=none"], text=False)
    assert dd.returncode == 0 and dd.stdout == expected[4000:]
