"""Scale: a 1,000-shard set served with a bounded number of open files; a tensor over 4 GiB at offsets past 2**32."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from stfs.daemon import daemon_pid
from tests.helpers import MountFn
from tests.models import tensor_bytes

pytestmark = pytest.mark.timeout(300)

GIB = 1 << 30
HELD = 256  # --max-open-files: past it, the least recently used sources are closed and reopened when read


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_thousand_shards_serve_with_bounded_descriptors(tmp_path, mount: MountFn) -> None:  # noqa: ANN001
    folder = tmp_path / "set"
    folder.mkdir()
    shards = 1000
    weight_map = {}
    for index in range(shards):
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        values = np.arange(4, dtype=np.int32) + index * 4
        header = json.dumps({f"layers.{index}.weight": {"dtype": "I32", "shape": [4], "data_offsets": [0, 16]}})
        with open(folder / name, "wb") as stream:
            stream.write(struct.pack("<Q", len(header)) + header.encode() + values.tobytes())
        weight_map[f"layers.{index}.weight"] = name
    index_path = folder / "model.safetensors.index.json"
    index_path.write_text(json.dumps({"metadata": {"total_size": 16 * shards}, "weight_map": weight_map}))

    mnt = mount(str(index_path), options=[f"max_open_files={HELD}"])
    pid = daemon_pid(mnt)
    idle = open_files(pid)
    most = idle
    for _ in range(2):  # the second round reopens shards the LRU closed
        for index in range(shards):
            path = os.path.join(mnt, "tensors", "layers", str(index), "weight")
            with open(path, "rb") as stream:
                os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # make the daemon read again
                data = stream.read()
            assert np.frombuffer(data, dtype=np.int32).tolist() == list(range(index * 4, index * 4 + 4))
            if index % 50 == 0:
                most = max(most, open_files(pid))
    most = max(most, open_files(pid))
    assert most <= idle + HELD, (idle, most)
    assert most < shards  # bounded: far fewer descriptors than shards
    assert len(os.listdir(os.path.join(mnt, "shards"))) == shards


def test_tensor_over_4_gib_at_offsets_past_2_32(tmp_path, mount: MountFn) -> None:  # noqa: ANN001
    huge = 4 * GIB + 3 * 4096 + 5  # over 4 GiB, and an odd length
    header = {
        "head": {"dtype": "U8", "shape": [7], "data_offsets": [0, 7]},
        "huge": {"dtype": "U8", "shape": [huge], "data_offsets": [7, 7 + huge]},
        "tail": {"dtype": "F32", "shape": [3], "data_offsets": [7 + huge, 7 + huge + 12]},
    }
    body = json.dumps(header).encode()
    path = str(tmp_path / "big.safetensors")
    data_start = 8 + len(body)
    with open(path, "wb") as stream:  # sparse: only the bytes written below take space
        stream.write(struct.pack("<Q", len(body)) + body + b"headhea")
        stream.truncate(data_start + 7 + huge + 12)
    huge_start = data_start + 7  # not page-aligned
    marks = {
        0: b"first bytes",
        2**32 - huge_start - 5: b"across 2**32",
        2**32 + 1234: b"past 2**32",
        huge - 9: b"last one!",
    }
    fd = os.open(path, os.O_WRONLY)
    try:
        for position, mark in marks.items():
            os.pwrite(fd, mark, huge_start + position)
        os.pwrite(fd, np.array([1.5, -2.0, 3.25], dtype=np.float32).tobytes(), huge_start + huge)
    finally:
        os.close(fd)

    mnt = mount(path)
    big = os.path.join(mnt, "tensors", "huge")
    assert os.stat(big).st_size == huge
    assert int(os.getxattr(big, "user.safetensors.offset")) == huge_start
    tail = os.path.join(mnt, "tensors", "tail")
    assert int(os.getxattr(tail, "user.safetensors.offset")) == huge_start + huge > 2**32
    with open(tail, "rb") as stream:
        assert stream.read() == tensor_bytes(path, "tail")
    source = os.open(path, os.O_RDONLY)
    served = os.open(big, os.O_RDONLY)
    try:
        for position, mark in marks.items():
            low = max(0, position - 3)  # a few zeros of the sparse file around each mark
            got = os.pread(served, 64, low)
            assert mark in got
            assert got == os.pread(source, min(64, huge - low), huge_start + low)
        assert os.pread(served, 100, huge - 2) == marks[huge - 9][-2:]  # short at the end
        assert os.pread(served, 100, huge) == b""
        # large reads spanning 2**32 in the tensor and in the source (the daemon's 1 MiB requests)
        for start in (2**32 - huge_start - 512 * 1024, 2**32 - 333):
            os.posix_fadvise(served, 0, 0, os.POSIX_FADV_DONTNEED)
            expected = os.pread(source, min(2 << 20, huge - start), huge_start + start)  # clamped at the end
            assert os.pread(served, 2 << 20, start) == expected
    finally:
        os.close(source)
        os.close(served)


def test_listings_hand_the_kernel_whole_folder_attributes(tmp_path, mount: MountFn) -> None:  # noqa: ANN001
    # Folders come back from READDIRPLUS with their attributes, which the kernel then keeps: all of them
    # must be right, not just the type and inode.
    names = [f"model.layers.{i}.mlp.{part}.weight" for i in range(40) for part in ("up", "down")]
    header = {name: {"dtype": "U8", "shape": [2], "data_offsets": [2 * i, 2 * i + 2]} for i, name in enumerate(names)}
    body = json.dumps(header).encode()
    path = str(tmp_path / "m.safetensors")
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(body)) + body + bytes(2 * len(names)))
    mtime = os.stat(path).st_mtime_ns
    mnt = mount(path)
    layers = os.path.join(mnt, "tensors", "model", "layers")
    listed = {entry.name: entry.inode() for entry in os.scandir(layers)}
    assert sorted(listed, key=int) == [str(i) for i in range(40)]
    for name, inode in listed.items():
        folder = os.stat(os.path.join(layers, name))  # answered from what the listing handed over
        assert folder.st_ino == inode
        assert oct(folder.st_mode) == oct(0o40555) and folder.st_nlink == 2 and folder.st_size == 0
        assert folder.st_mtime_ns == mtime and folder.st_uid == os.getuid()
    assert sorted(os.listdir(os.path.join(layers, "3", "mlp"))) == ["down", "up"]


def test_a_long_flat_listing_arrives_whole(tmp_path, mount: MountFn) -> None:  # noqa: ANN001
    count = 5000  # a listing the kernel fetches a few KiB at a time
    header = {f"t{i:05d}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(count)}
    body = json.dumps(header).encode()
    path = str(tmp_path / "flat.safetensors")
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(body)) + body + bytes(i % 256 for i in range(count)))
    mnt = mount(path, layout="flat")
    names = os.listdir(os.path.join(mnt, "tensors"))
    assert len(names) == count and sorted(names) == sorted(header)
    with open(os.path.join(mnt, "tensors", "t04999"), "rb") as stream:
        assert stream.read() == bytes([4999 % 256])
