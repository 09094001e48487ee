"""A mount is a snapshot: every byte read is the byte the source held at mount time, or the read fails with EIO.

What a training job does to a checkpoint under a mount (rename a new one over it, rewrite it in place,
delete it), with real mounts and real files; never a mix of two versions.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from stfs.daemon import daemon_pid
from tests.helpers import MountFn, changed, read_cold, run, tensor_path
from tests.models import tensor_bytes, write_numpy, write_sharded

pytestmark = pytest.mark.timeout(300)

MIB = 1 << 20


def old_or_eio(path: str, expected: bytes, offset: int = 0) -> str:
    """``"old"`` if a cold read returns ``expected``, ``"eio"`` if it fails with EIO; anything else fails the test."""
    try:
        data = read_cold(path, offset, len(expected))
    except OSError as exc:
        assert exc.errno == errno.EIO, exc
        return "eio"
    assert data == expected, f"{path}: bytes of another version"
    return "old"


def arrays(version: int, count: int = 8, size: int = 64 * 1024) -> dict[str, np.ndarray]:
    """Same names, shapes and dtypes for every version (so the same header), different values."""
    rng = np.random.default_rng(version)
    return {f"layers.{index}.weight": rng.integers(0, 256, size, dtype=np.uint8) for index in range(count)}


def replace_by_rename(path: str, new: dict[str, np.ndarray]) -> None:
    """What a training job does: write ``path.tmp``, then rename it over ``path``."""
    write_numpy(path + ".tmp", new)
    os.replace(path + ".tmp", path)


def rewrite_in_place(path: str, new: dict[str, np.ndarray]) -> None:
    """The same bytes a save would write, through the same inode (mtime moves, size and header do not)."""
    write_numpy(path + ".new", new)
    with open(path + ".new", "rb") as fresh, open(path, "r+b") as old:
        old.write(fresh.read())
    os.unlink(path + ".new")
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a coarse clock might not have moved


def header_of(path: str) -> bytes:
    with open(path, "rb") as stream:
        return stream.read(int.from_bytes(stream.read(8), "little"))


@pytest.mark.parametrize("read_before", [False, True], ids=["before-any-read", "after-some-reads"])
def test_rename_over_with_the_same_header_keeps_the_old_bytes(
    mount: MountFn, tmp_path: Path, read_before: bool
) -> None:
    source = write_numpy(str(tmp_path / "m.safetensors"), arrays(1))
    old = {name: tensor_bytes(source, name) for name in arrays(1)}
    mnt = mount(source)
    header = header_of(source)
    if read_before:
        for name in list(old)[:4]:
            assert read_cold(tensor_path(mnt, name)) == old[name]
    replace_by_rename(source, arrays(2))
    assert header_of(source) == header and all(tensor_bytes(source, n) != old[n] for n in old)
    for name, data in old.items():
        assert read_cold(tensor_path(mnt, name)) == data  # the held descriptor: the old file, not EIO
    assert changed(mnt) == [source]
    assert sorted(os.listdir(os.path.join(mnt, "tensors", "layers"))) == sorted(str(i) for i in range(8))
    assert (
        run(["cmp", tensor_path(mnt, "layers.3.weight"), "-"], input=old["layers.3.weight"], text=False).returncode == 0
    )


def test_a_sharded_checkpoint_replaced_halfway_through_a_read(mount: MountFn, tmp_path: Path) -> None:
    def checkpoint(version: int) -> dict[str, dict[str, np.ndarray]]:
        names = list(arrays(version, count=16))
        values = arrays(version, count=16)
        return {
            f"model-{s + 1:05d}-of-00004.safetensors": {n: values[n] for n in names[s * 4 : s * 4 + 4]}
            for s in range(4)
        }

    index = write_sharded(str(tmp_path / "ckpt"), checkpoint(1))
    old = {name: array.tobytes() for shard in checkpoint(1).values() for name, array in shard.items()}
    mnt = mount(index)
    names = sorted(old)
    for name in names[:8]:
        assert read_cold(tensor_path(mnt, name)) == old[name]
    fresh = write_sharded(str(tmp_path / "next"), checkpoint(2))  # the next checkpoint, then moved into place
    for file in sorted(os.listdir(os.path.dirname(fresh))):
        os.replace(os.path.join(os.path.dirname(fresh), file), os.path.join(os.path.dirname(index), file))
    for name in names:
        assert read_cold(tensor_path(mnt, name)) == old[name], name
    folder = os.path.dirname(index)
    assert changed(mnt) == sorted(os.path.join(folder, file) for file in os.listdir(folder))  # index included


@pytest.mark.parametrize("held", [None, 100], ids=["every-shard-held", "100-held"])
def test_three_hundred_shards_with_shard_150_replaced(mount: MountFn, tmp_path: Path, held: int | None) -> None:
    shards = {
        f"model-{s:05d}-of-00300.safetensors": {f"layers.{s}.weight": np.full(64, s % 251, np.uint8)}
        for s in range(1, 301)
    }
    index = write_sharded(str(tmp_path / "set"), shards)
    mnt = mount(index, options=[f"max_open_files={held}"] if held else None)
    for s in range(1, 301, 7):
        assert read_cold(tensor_path(mnt, f"layers.{s}.weight")) == bytes([s % 251]) * 64
    target = os.path.join(os.path.dirname(index), "model-00150-of-00300.safetensors")
    replace_by_rename(target, {"layers.150.weight": np.full(64, 7, np.uint8)})
    outcomes = {s: old_or_eio(tensor_path(mnt, f"layers.{s}.weight"), bytes([s % 251]) * 64) for s in range(1, 301)}
    if held is None:  # more shards than the old descriptor cache held: every one still open
        assert set(outcomes.values()) == {"old"}
    else:  # shard 150 may have been closed for room: then its path no longer holds it, and EIO it is
        assert {s for s, outcome in outcomes.items() if outcome == "eio"} <= {150}
    assert changed(mnt) == [target]


def test_deleted_then_recreated_source_keeps_serving_the_old_bytes(mount: MountFn, tmp_path: Path) -> None:
    source = write_numpy(str(tmp_path / "m.safetensors"), arrays(1))
    old = {name: tensor_bytes(source, name) for name in arrays(1)}
    mnt = mount(source)
    os.unlink(source)
    assert read_cold(tensor_path(mnt, "layers.0.weight")) == old["layers.0.weight"]
    assert changed(mnt) == [source]
    write_numpy(source, arrays(3))  # a new file at the same path
    for name, data in old.items():
        assert read_cold(tensor_path(mnt, name)) == data
    assert changed(mnt) == [source]


@pytest.mark.parametrize("how", ["rename", "in-place"])
def test_a_rewrite_between_two_reads_of_one_tensor_never_mixes(mount: MountFn, tmp_path: Path, how: str) -> None:
    big = {"big": np.random.default_rng(5).integers(0, 256, 8 * MIB, dtype=np.uint8)}
    source = write_numpy(str(tmp_path / "m.safetensors"), big)
    old = tensor_bytes(source, "big")
    mnt = mount(source)
    path = tensor_path(mnt, "big")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: the second half is not yet read
        assert os.pread(fd, 4 * MIB, 0) == old[: 4 * MIB]
        new = {"big": np.random.default_rng(6).integers(0, 256, 8 * MIB, dtype=np.uint8)}
        (replace_by_rename if how == "rename" else rewrite_in_place)(source, new)
        try:
            second = os.pread(fd, 4 * MIB, 4 * MIB)
        except OSError as exc:
            assert how == "in-place" and exc.errno == errno.EIO  # renamed over: the old file is still held
        else:
            assert second == old[4 * MIB :]
    finally:
        os.close(fd)
    outcome = old_or_eio(path, old)
    assert outcome == ("old" if how == "rename" else "eio")
    assert changed(mnt) == [source]


def test_an_in_place_rewrite_with_the_same_header_is_eio(mount: MountFn, tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    source = write_numpy(str(folder / "a.safetensors"), arrays(1))
    other = write_numpy(str(folder / "b.safetensors"), arrays(9))
    mnt = mount(str(folder))
    assert changed(mnt) == []
    before = read_cold(tensor_path(os.path.join(mnt, "a"), "layers.0.weight"))
    rewrite_in_place(source, arrays(2))
    assert os.path.getsize(source) == os.path.getsize(other) and header_of(source) == header_of(other)
    assert old_or_eio(tensor_path(os.path.join(mnt, "a"), "layers.0.weight"), before) in ("old", "eio")
    for name in list(arrays(1))[1:]:  # never read before: nothing cached, so EIO
        with pytest.raises(OSError) as caught:
            read_cold(tensor_path(os.path.join(mnt, "a"), name))
        assert caught.value.errno == errno.EIO
    assert changed(mnt) == [source]
    # the rest of the mount serves on: the other model, listings, metadata
    for name in arrays(9):
        assert read_cold(tensor_path(os.path.join(mnt, "b"), name)) == tensor_bytes(other, name)
    assert sorted(os.listdir(mnt)) == ["a", "b", "files"]
    pid = daemon_pid(mnt)
    assert pid is not None and os.path.exists(f"/proc/{pid}")


def test_a_fresh_mount_reports_no_change(mount: MountFn, tmp_path: Path) -> None:
    source = write_numpy(str(tmp_path / "m.safetensors"), arrays(1))
    rewrite_in_place(source, arrays(2))  # before the mount: this version is the mounted one
    mnt = mount(source)
    assert changed(mnt) == []
    assert read_cold(tensor_path(mnt, "layers.0.weight")) == tensor_bytes(source, "layers.0.weight")
    assert "user.stfs.changed" in os.listxattr(mnt)


def test_unmount_after_a_change(tmp_path: Path, require_fuse: None) -> None:
    source = write_numpy(str(tmp_path / "m.safetensors"), arrays(1))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    assert run(["stfs", "mount", source, str(mnt)]).returncode == 0
    try:
        rewrite_in_place(source, arrays(2))
        with pytest.raises(OSError):
            read_cold(tensor_path(str(mnt), "layers.1.weight"))
        shutil.copy(source, tmp_path / "copy.safetensors")  # the source itself stays readable to everyone else
    finally:
        result = run(["stfs", "unmount", str(mnt)])
    assert result.returncode == 0, result.stderr
    assert not os.path.ismount(mnt)
