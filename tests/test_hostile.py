"""Hostile input: what the fuzzer found (fuzz/fuzz_header.py), and valid files built to hurt.

Run as a script to measure a mount of a huge header (docs/reliability.md):

    python3 -m tests.test_hostile 1000000 /work/rel-data/hostile
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from stfs import errors, model, tree, views
from tests.helpers import MountFn, run
from tests.models import tensor_bytes, write_header, write_numpy

pytestmark = pytest.mark.timeout(120)

NAME_MAX = 255


# -- regressions from fuzzing --------------------------------------------------------------------------------------


def _load_and_build(path: str) -> None:
    """What ``stfs mount`` does before mounting; only StfsError may come out."""
    for source in model.discover(path):
        loaded = model.load(source)
        if loaded.is_sharded:
            views.merged_header(loaded)
        views.build_tree([loaded])


def test_index_with_an_empty_weight_map_is_not_a_traceback(tmp_path: os.PathLike) -> None:
    index = os.path.join(str(tmp_path), "m.safetensors.index.json")
    with open(index, "w") as stream:
        json.dump({"metadata": {"total_size": 0}, "weight_map": {}}, stream)
    with contextlib.suppress(errors.StfsError):
        _load_and_build(index)
    mountpoint = os.path.join(str(tmp_path), "mnt")
    os.mkdir(mountpoint)
    result = run([sys.executable, "-m", "stfs", "mount", index, mountpoint])
    if result.returncode == 0:
        run([sys.executable, "-m", "stfs", "unmount", mountpoint])
    assert "Traceback" not in result.stderr
    assert result.returncode == 1 and "weight_map names no tensor" in result.stderr


def _surrogate_header(where: str) -> bytes:
    name, meta_key, meta_value = "w", "k", "v"
    if where == "name":
        name = "w\\udd5a"
    elif where == "metadata key":
        meta_key = "\\ud800k"
    elif where == "metadata value":
        meta_value = "v\\udfff"
    elif where == "dtype":
        return b'{"w":{"dtype":"F32\\ud800","shape":[1],"data_offsets":[0,4]}}'
    metadata = f'"__metadata__":{{"{meta_key}":"{meta_value}"}}'
    return ("{" + metadata + f',"{name}":{{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}}}').encode()


@pytest.mark.parametrize("where", ["name", "metadata key", "metadata value", "dtype"])
def test_a_lone_surrogate_in_a_shard_is_refused_not_a_crash(tmp_path: os.PathLike, where: str) -> None:
    """Fuzz crash: a \\udd5a escape in a shard's tensor name reached merged_header's UTF-8 encode."""
    folder = str(tmp_path)
    write_header(os.path.join(folder, "a.safetensors"), None, data=b"\0" * 4, raw=_surrogate_header(where))
    index = os.path.join(folder, "m.safetensors.index.json")
    with open(index, "w") as stream:
        stream.write('{"weight_map": {"w": "a.safetensors"}}')
    with pytest.raises(errors.StfsError):
        _load_and_build(index)
    with pytest.raises(errors.StfsError):
        _load_and_build(os.path.join(folder, "a.safetensors"))
    result = run([sys.executable, "-m", "stfs", "check", index])
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "index_text",
    [
        '{"weight_map": {"w\\ud800": "a.safetensors"}}',
        '{"weight_map": {"w": "a\\ud800.safetensors"}}',
        '{"weight_map": {"w": "a\\u0000.safetensors"}}',
        '{"weight_map": {"w": ""}}',
        '{"weight_map": {"w": "."}}',
        '{"weight_map": {"w": "m.safetensors.index.json"}}',
        '{"weight_map": {"w": "a.safetensors", "x": "./a.safetensors"}}',
        '{"weight_map": {"w": 1}}',
        '{"weight_map": []}',
        '{"metadata": [], "weight_map": {"w": "a.safetensors"}}',
        '{"metadata": {"total_size": "NaN"}, "weight_map": {"w": "a.safetensors"}}',
        "[" * 100_000 + "]" * 100_000,
        '{"weight_map": {"w": "a.safetensors"}, "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"weight_map": {"w": "a.safetensors"}, "x": ' + "9" * 5000 + "}",
        '\ufeff{"weight_map": {"w": "a.safetensors"}}',
        "",
    ],
)
def test_hostile_indexes_give_stfs_errors_only(tmp_path: os.PathLike, index_text: str) -> None:
    folder = str(tmp_path)
    write_numpy(os.path.join(folder, "a.safetensors"), {"w": np.zeros(2, np.float32)})
    index = os.path.join(folder, "m.safetensors.index.json")
    with open(index, "w", encoding="utf-8", errors="surrogatepass") as stream:
        stream.write(index_text)
    with contextlib.suppress(errors.StfsError):
        _load_and_build(index)


HOSTILE_HEADERS = [
    b"{" * 50_000,
    b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}",
    b'{"__metadata__":' + b'{"a":' * 50_000 + b'"x"' + b"}" * 50_000 + b"}",
    b'{"t":{"dtype":"F32","shape":[' + b"9" * 100_000 + b'],"data_offsets":[0,4]}}',
    b'{"t":{"dtype":"F32","shape":[1e400],"data_offsets":[0,4]}}',
    b'{"t":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}',
    b'{"t":{"dtype":"F32","shape":[NaN],"data_offsets":[0,4]}}',
    b'{"t":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,4]}}',
    b'{"t":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}}',
    b'{"t":{"dtype":"F4","shape":[1],"data_offsets":[0,0]}}',
    b'{"t":{"dtype":"BOOL","shape":[true],"data_offsets":[0,1]}}',
    b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551615,3]}}',
    b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    b'{"\xed\xa0\x80":1}',
    b'{"\xc0\xaf":1}',
    b'{"t\\u0000\\u202e\\ufeff":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}',
    b"{}" + b" " * 1000 + b"x",
    b"{}\x00",
]


@pytest.mark.parametrize("raw", HOSTILE_HEADERS, ids=range(len(HOSTILE_HEADERS)))
def test_hostile_headers_give_format_errors_only(tmp_path: os.PathLike, raw: bytes) -> None:
    path = write_header(os.path.join(str(tmp_path), "h.safetensors"), None, raw=raw)
    try:
        header = model.read_header(path)
    except errors.StfsError:
        return
    views.build_tree(model.resolve(path))
    assert all(entry.end >= entry.begin for entry in header.tensors)


# -- valid but hostile -----------------------------------------------------------------------------------------------


def many_tensors_name(index: int, pad: str = "") -> str:
    return f"model.layers.{index // 1000}.block{pad}.{index % 1000}.weight"


def write_many_tensors(path: str, count: int, pad: str = "") -> int:
    """A valid file of ``count`` one-byte U8 tensors (tensor ``i`` holds ``i % 251``); returns the header length."""
    parts = [
        f'"{many_tensors_name(i, pad)}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}' for i in range(count)
    ]
    raw = ("{" + ",".join(parts) + "}").encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(raw)))
        stream.write(raw)
        stream.write((np.arange(count) % 251).astype(np.uint8).tobytes())
    return len(raw)


def test_fifty_thousand_tiny_tensors(mount: MountFn, tmp_path: os.PathLike) -> None:
    count = 50_000
    source = os.path.join(str(tmp_path), "many.safetensors")
    write_many_tensors(source, count)
    mnt = mount(source)
    assert os.statvfs(mnt).f_files >= count
    layers = os.listdir(os.path.join(mnt, "tensors", "model", "layers"))
    assert len(layers) == count // 1000
    files = sum(len(os.listdir(os.path.join(mnt, "tensors", "model", "layers", layer, "block"))) for layer in layers)
    assert files == count
    rng = random.Random(3)
    for index in [0, count - 1, *rng.sample(range(count), 200)]:
        path = os.path.join(mnt, "tensors", *many_tensors_name(index).split("."))
        with open(path, "rb") as stream:
            assert stream.read() == bytes([index % 251])
        assert os.getxattr(path, "user.safetensors.name").decode() == many_tensors_name(index)


LONG_NAMES = {
    "one component of 10,000 characters": "x" * 10_000,
    "10,000 bytes of two-byte characters": "é" * 5_000,
    "a 300-byte component between short ones": "model." + "p" * 300 + ".weight",
    "the same first 200 bytes, then different": "model." + "q" * 250 + "A",
    "the same first 200 bytes, then different too": "model." + "q" * 250 + "B",
    "cut inside a multi-byte character": "model." + "a" + "€" * 100,
    "a long component that needs escaping": "model." + "/%" * 200,
    "10,000 characters in 1,000 components (a path beyond PATH_MAX)": "abcdefghi." * 1_000,
}


def _find(mnt: str, name: str) -> str | int:
    """The tensor ``name`` in the mount: a path, or for a path beyond PATH_MAX an fd opened step by step."""
    components = tree.split_name(name, "nested")
    if sum(len(c.encode("utf-8", "surrogatepass")) + 1 for c in components) < 3000:
        return os.path.join(mnt, "tensors", *components)
    fd = os.open(os.path.join(mnt, "tensors"), os.O_RDONLY | os.O_DIRECTORY)
    for component in components:
        child = os.open(component, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = child
    return fd


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_long_names_are_reachable_readable_and_named_in_xattrs(
    mount: MountFn, tmp_path: os.PathLike, layout: str
) -> None:
    arrays = {name: np.full(index + 1, index, dtype=np.int16) for index, name in enumerate(LONG_NAMES.values())}
    source = write_numpy(os.path.join(str(tmp_path), "long.safetensors"), arrays)
    mnt = mount(source, layout=layout)
    found: dict[str, bytes] = {}
    # every entry of every folder fits NAME_MAX, and every tensor is found by listing
    stack = [os.open(os.path.join(mnt, "tensors"), os.O_RDONLY | os.O_DIRECTORY)]
    while stack:
        fd = stack.pop()
        for entry in os.listdir(fd):
            assert len(entry.encode("utf-8", "surrogateescape")) <= NAME_MAX
            child = os.open(entry, os.O_RDONLY, dir_fd=fd)
            if os.path.isdir(f"/proc/self/fd/{child}"):
                stack.append(child)
                continue
            found[os.getxattr(child, "user.safetensors.name").decode()] = os.read(child, 1 << 20)
            os.close(child)
        os.close(fd)
    assert found == {name: array.tobytes() for name, array in arrays.items()}
    if layout == "nested":
        for name, array in arrays.items():
            target = _find(mnt, name)
            fd = target if isinstance(target, int) else os.open(target, os.O_RDONLY)
            try:
                assert os.read(fd, 1 << 20) == array.tobytes()
                assert os.getxattr(fd, "user.safetensors.name").decode() == name
            finally:
                os.close(fd)


def test_a_name_too_long_for_an_xattr_is_still_a_readable_file(mount: MountFn, tmp_path: os.PathLike) -> None:
    """Linux caps an xattr value at 64 KiB: the name attribute fails cleanly, the file and the daemon live on."""
    name = "n" * 70_000
    source = write_numpy(
        os.path.join(str(tmp_path), "huge-name.safetensors"),
        {name: np.arange(3, dtype=np.int8), "ok": np.ones(2, np.int8)},
    )
    mnt = mount(source)
    (entry,) = [e for e in os.listdir(os.path.join(mnt, "tensors")) if e.startswith("n")]
    path = os.path.join(mnt, "tensors", entry)
    with open(path, "rb") as stream:
        assert stream.read() == tensor_bytes(source, name)
    with pytest.raises(OSError) as caught:
        os.getxattr(path, "user.safetensors.name")
    assert caught.value.errno in (errno.E2BIG, errno.ERANGE)
    assert os.getxattr(path, "user.safetensors.dtype") == b"I8"
    with open(os.path.join(mnt, "tensors", "ok"), "rb") as stream:
        assert stream.read() == b"\1\1"


# -- the 1M-tensor measurement (a script run, not a test) ---------------------------------------------------------


def _daemon_memory(mountpoint: str) -> dict[str, int]:
    from stfs.daemon import daemon_pid

    pid = daemon_pid(mountpoint)
    assert pid is not None
    values = {"pid": pid}
    with open(f"/proc/{pid}/status") as stream:
        for line in stream:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                values[key + "_kB"] = int(rest.split()[0])
    return values


def measure(count: int, folder: str) -> dict[str, object]:
    """Write a ``count``-tensor file (header near 100 MB for 1M), time ``stfs mount`` and read the daemon's memory."""
    os.makedirs(folder, exist_ok=True)
    source = os.path.join(folder, f"many-{count}.safetensors")
    mountpoint = os.path.join(folder, "mnt")
    os.makedirs(mountpoint, exist_ok=True)
    pad = "_pad" if count >= 1_000_000 else ""  # 1M tensors: a header of about 97 MB (the limit is 100,000,000)
    header_length = write_many_tensors(source, count, pad)
    start = time.monotonic()
    result = subprocess.run(["stfs", "mount", source, mountpoint], capture_output=True, text=True)
    ready = time.monotonic() - start
    report: dict[str, object] = {
        "tensors": count,
        "header_bytes": header_length,
        "mount_exit": result.returncode,
        "stderr": result.stderr.strip()[:500],
        "seconds_to_ready": round(ready, 1),
    }
    if result.returncode == 0:
        try:
            report["daemon_after_mount"] = _daemon_memory(mountpoint)
            walk_start = time.monotonic()
            files = sum(len(names) for _, _, names in os.walk(os.path.join(mountpoint, "tensors")))
            report["files_listed"] = files
            report["seconds_to_list_all"] = round(time.monotonic() - walk_start, 1)
            for index in (0, count // 2, count - 1):
                path = os.path.join(mountpoint, "tensors", *many_tensors_name(index, pad).split("."))
                with open(path, "rb") as stream:
                    assert stream.read() == bytes([index % 251]), path
            report["daemon_after_listing"] = _daemon_memory(mountpoint)
        finally:
            subprocess.run(["stfs", "unmount", mountpoint])
    os.unlink(source)
    return report


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), sys.argv[2]), indent=2))
