"""The FUSE callbacks and the byte source, called directly: no mount, real files."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest
from mfusepy import FuseOSError

from stfs.fs import StfsOperations
from stfs.model import resolve
from stfs.sources import LocalFiles, SourceChanged
from stfs.views import build_tree
from tests.models import rich_arrays, tensor_bytes, write_numpy


@pytest.fixture
def rich(tmp_path) -> str:  # noqa: ANN001
    return write_numpy(str(tmp_path / "rich.safetensors"), rich_arrays(), metadata={"format": "pt"})


def operations_for(path: str) -> StfsOperations:
    source = LocalFiles()  # validation pins each file; the operations read the pinned files
    return StfsOperations(build_tree(resolve(path, source)), source)


def errno_of(call, *args) -> int:  # noqa: ANN001, ANN002
    with pytest.raises(FuseOSError) as caught:
        call(*args)
    return caught.value.errno


def test_read_is_exact_and_clamped(rich: str) -> None:
    ops = operations_for(rich)
    path = "/tensors/model/embed_tokens/weight"
    expected = tensor_bytes(rich, "model.embed_tokens.weight")
    fh = ops.open(path, os.O_RDONLY)
    assert ops.read(path, len(expected), 0, fh) == expected
    assert ops.read(path, 10, len(expected) - 4, fh) == expected[-4:]
    assert ops.read(path, 10, len(expected) + 100, fh) == b""
    buffer = bytearray(16)
    assert ops.fill(ops.file(None, fh), memoryview(buffer), 8) == 16 and bytes(buffer) == expected[8:24]


def test_attributes(rich: str) -> None:
    ops = operations_for(rich)
    attrs = ops.getattr("/tensors/scalar")
    assert attrs["st_mode"] == 0o100444 and attrs["st_size"] == 4 and attrs["st_blocks"] == 1
    assert attrs["st_mtime"] == os.stat(rich).st_mtime_ns
    assert ops.getattr("/tensors")["st_mode"] == 0o040555
    names = [entry if isinstance(entry, str) else entry[0] for entry in ops.readdir("/", 0)]
    assert names == [".", "..", "header.json", "metadata", "tensors"]
    assert ops.statfs("/")["f_blocks"] * 4096 >= sum(a.nbytes for a in rich_arrays().values())


def test_errno_answers(rich: str) -> None:
    ops = operations_for(rich)
    assert errno_of(ops.getattr, "/missing") == errno.ENOENT
    assert errno_of(ops.open, "/tensors", os.O_RDONLY) == errno.EISDIR
    assert errno_of(ops.open, "/tensors/scalar", os.O_WRONLY) == errno.EROFS
    assert errno_of(ops.open, "/tensors/scalar", os.O_RDWR) == errno.EROFS
    assert errno_of(ops.readdir, "/tensors/scalar", 0) == errno.ENOTDIR
    assert errno_of(ops.getxattr, "/tensors/scalar", "user.other") == errno.ENODATA
    assert errno_of(ops.access, "/tensors/scalar", os.W_OK) == errno.EROFS
    for mutate, args in [
        (ops.write, ("/tensors/scalar", b"x", 0, 0)),
        (ops.unlink, ("/tensors/scalar",)),
        (ops.mkdir, ("/x", 0o755)),
        (ops.rename, ("/a", "/b")),
        (ops.chmod, ("/", 0o777)),
        (ops.truncate, ("/tensors/scalar", 0)),
        (ops.create, ("/new", 0o644)),
        (ops.setxattr, ("/tensors/scalar", "user.x", b"1", 0)),
    ]:
        assert errno_of(mutate, *args) == errno.EROFS, mutate


def test_xattrs(rich: str) -> None:
    ops = operations_for(rich)
    path = "/tensors/model/layers/0/mlp/up_proj/weight"
    keys = ("dtype", "file", "name", "offset", "shape")
    assert sorted(ops.listxattr(path)) == [f"user.safetensors.{k}" for k in keys]
    assert ops.getxattr(path, "user.safetensors.shape") == b"[32,16]"
    assert ops.listxattr("/tensors") == []


def test_truncated_source_is_eio_for_every_read(tmp_path) -> None:  # noqa: ANN001
    source = write_numpy(str(tmp_path / "t.safetensors"), {"a": np.arange(1000.0), "b": np.arange(1000.0)})
    ops = operations_for(source)
    fh_a, fh_b = ops.open("/tensors/a", os.O_RDONLY), ops.open("/tensors/b", os.O_RDONLY)
    assert ops.read("/tensors/a", 8000, 0, fh_a) == tensor_bytes(source, "a")
    os.truncate(source, os.path.getsize(source) - 100)  # a change in place: the mounted version is gone
    assert errno_of(ops.read, "/tensors/a", 8000, 0, fh_a) == errno.EIO  # bytes before the new end too
    assert errno_of(ops.read, "/tensors/b", 8000, 0, fh_b) == errno.EIO
    assert json.loads(ops.getxattr("/", "user.stfs.changed")) == [source]


def rewrite_in_place(source: str, arrays: dict[str, np.ndarray]) -> None:
    """Overwrite ``source`` through its own inode (safetensors' save_file would replace the inode)."""
    fresh = write_numpy(source + ".new", arrays)
    with open(fresh, "rb") as new, open(source, "r+b") as old:
        old.write(new.read())
    os.utime(source, ns=(1, 1))


def test_rewritten_header_is_eio(tmp_path) -> None:  # noqa: ANN001
    source = write_numpy(str(tmp_path / "t.safetensors"), {"a": np.arange(100.0)})
    ops = operations_for(source)
    fh = ops.open("/tensors/a", os.O_RDONLY)
    assert ops.read("/tensors/a", 16, 0, fh) == tensor_bytes(source, "a")[:16]
    rewrite_in_place(source, {"b": np.arange(100.0) * 3})  # same size, different header
    assert errno_of(ops.read, "/tensors/a", 16, 0, fh) == errno.EIO


def test_same_header_rewritten_is_eio_never_new_bytes(tmp_path) -> None:  # noqa: ANN001
    source = write_numpy(str(tmp_path / "t.safetensors"), {"a": np.arange(100.0)})
    ops = operations_for(source)
    assert json.loads(ops.getxattr("/", "user.stfs.changed")) == []
    fh = ops.open("/tensors/a", os.O_RDONLY)
    ops.read("/tensors/a", 16, 0, fh)
    rewrite_in_place(source, {"a": np.arange(100.0) + 1})  # same header, same size, new bytes, mtime moved
    assert errno_of(ops.read, "/tensors/a", 800, 0, fh) == errno.EIO
    assert json.loads(ops.getxattr("/", "user.stfs.changed")) == [source]


def test_replaced_by_rename_serves_the_old_bytes(tmp_path) -> None:  # noqa: ANN001
    source = write_numpy(str(tmp_path / "t.safetensors"), {"a": np.arange(100.0)})
    old = tensor_bytes(source, "a")
    ops = operations_for(source)
    fh = ops.open("/tensors/a", os.O_RDONLY)
    ops.read("/tensors/a", 16, 0, fh)
    os.replace(write_numpy(source + ".new", {"b": np.arange(100.0) * 7}), source)
    assert ops.read("/tensors/a", 800, 0, fh) == old


def test_open_descriptors_are_bounded(tmp_path) -> None:  # noqa: ANN001
    paths = [write_numpy(str(tmp_path / f"f{i}.safetensors"), {"x": np.full(10, i, np.int32)}) for i in range(12)]
    files = LocalFiles(max_open=3)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(2):
        for i, path in enumerate(paths):
            buffer = bytearray(40)
            files.read_into(path, os.path.getsize(path) - 40, memoryview(buffer))
            assert bytes(buffer) == np.full(10, i, np.int32).tobytes()
            assert len(os.listdir("/proc/self/fd")) - before <= 3
    files.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_missing_file_raises_oserror(tmp_path) -> None:  # noqa: ANN001
    files = LocalFiles()
    with pytest.raises(OSError):
        files.read_into(str(tmp_path / "gone"), 0, memoryview(bytearray(4)))
    assert issubclass(SourceChanged, OSError)
