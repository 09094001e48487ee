"""The mount, for real: every file, byte and attribute read back through the kernel with real tools."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stfs.daemon import daemon_pid, mounted
from stfs.tree import split_name
from tests.helpers import REPO, run
from tests.models import (
    WEIRD_NAMES,
    rich_arrays,
    sharded_arrays,
    tensor_bytes,
    write_header,
    write_numpy,
    write_raw,
    write_sharded,
)

pytestmark = pytest.mark.timeout(120)

METADATA = {"format": "pt", "note": "hello\nworld", "k/ey": "slash"}


@pytest.fixture
def rich(tmp_path) -> str:  # noqa: ANN001
    return write_numpy(str(tmp_path / "rich.safetensors"), rich_arrays(), metadata=METADATA)


def tensor_path(mnt: str, name: str, layout: str = "nested") -> str:
    return os.path.join(mnt, "tensors", *split_name(name, layout))


def raw_header(path: str) -> bytes:
    with open(path, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        return stream.read(length)


def header_of(path: str) -> dict:
    return json.loads(raw_header(path))


def read_file(path: str) -> bytes:
    with open(path, "rb") as stream:
        return stream.read()


def check_tensors(
    mnt: str, source: str, names: list[str], layout: str = "nested", paths: dict[str, str] | None = None
) -> None:
    header = header_of(source)
    data_start = 8 + len(raw_header(source))
    for name in names:
        path = paths[name] if paths else tensor_path(mnt, name, layout)
        expected = tensor_bytes(source, name)
        info = os.stat(path)
        assert stat.S_IMODE(info.st_mode) == 0o444 and stat.S_ISREG(info.st_mode)
        assert info.st_size == len(expected)
        assert info.st_mtime_ns == os.stat(source).st_mtime_ns
        assert read_file(path) == expected, name
        assert os.getxattr(path, "user.safetensors.name") == name.encode()
        assert os.getxattr(path, "user.safetensors.dtype") == header[name]["dtype"].encode()
        assert json.loads(os.getxattr(path, "user.safetensors.shape")) == header[name]["shape"]
        assert os.getxattr(path, "user.safetensors.file") == os.path.abspath(source).encode()
        offset = int(os.getxattr(path, "user.safetensors.offset"))
        assert offset == data_start + header[name]["data_offsets"][0]


def test_rich_single_file(mount, rich: str) -> None:  # noqa: ANN001
    mnt = mount(rich)
    assert sorted(os.listdir(mnt)) == ["files", "header.json", "metadata", "tensors"]
    check_tensors(mnt, rich, list(rich_arrays()))
    assert read_file(os.path.join(mnt, "header.json")) == raw_header(rich).rstrip(b" ")
    assert sorted(os.listdir(os.path.join(mnt, "metadata"))) == sorted(["format", "note", "k%2Fey"])
    assert read_file(os.path.join(mnt, "metadata", "note")) == b"hello\nworld\n"
    assert read_file(os.path.join(mnt, "metadata", "k%2Fey")) == b"slash\n"
    for folder in (mnt, os.path.join(mnt, "tensors", "model", "layers")):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o555
    assert sorted(os.listdir(os.path.join(mnt, "tensors", "model", "layers"))) == ["0", "1"]


def test_bf16_and_f8_tensors(mount, tmp_path) -> None:  # noqa: ANN001
    data = {"w.bf16": ("BF16", [3, 2], bytes(range(12))), "w.f8": ("F8_E4M3", [5], b"\x01\x02\x03\x04\x05")}
    source = write_raw(str(tmp_path / "low.safetensors"), data)
    mnt = mount(source)
    check_tensors(mnt, source, list(data))


def test_sharded_set_as_directory_and_as_index(mount, tmp_path) -> None:  # noqa: ANN001
    shards = sharded_arrays()
    index = write_sharded(
        str(tmp_path / "repo"),
        shards,
        metadata={
            "model-00001-of-00002.safetensors": {"format": "pt", "who": "first"},
            "model-00002-of-00002.safetensors": {"format": "pt", "who": "second", "extra": "x"},
        },
    )
    for source in (str(tmp_path / "repo"), index):
        mnt = mount(source)
        assert sorted(os.listdir(mnt)) == ["files", "header.json", "index.json", "metadata", "shards", "tensors"]
        assert read_file(os.path.join(mnt, "index.json")) == read_file(index)
        for shard_name, arrays in shards.items():
            shard_path = os.path.join(str(tmp_path / "repo"), shard_name)
            check_tensors(mnt, shard_path, list(arrays))
            shard_dir = os.path.join(mnt, "shards", shard_name)
            assert read_file(os.path.join(shard_dir, "header.json")) == raw_header(shard_path).rstrip(b" ")
            assert read_file(os.path.join(shard_dir, "metadata", "who")) in (b"first\n", b"second\n")
        merged = json.loads(read_file(os.path.join(mnt, "header.json")))
        assert merged["__metadata__"] == {"format": "pt", "who": "first", "extra": "x"}
        assert merged["lm_head.weight"]["file"] == "model-00002-of-00002.safetensors"
        assert (
            merged["lm_head.weight"]["data_offsets"]
            == header_of(os.path.join(str(tmp_path / "repo"), "model-00002-of-00002.safetensors"))["lm_head.weight"][
                "data_offsets"
            ]
        )
        assert read_file(os.path.join(mnt, "metadata", "who")) == b"first\n"
        query = '.["model.layers.0.mlp.down_proj.weight"].shape | @csv'
        jq = run(["jq", "-r", query, os.path.join(mnt, "header.json")])
        assert jq.returncode == 0 and jq.stdout.strip() == "8,24"


def test_multi_model_directory(mount, tmp_path) -> None:  # noqa: ANN001
    repo = tmp_path / "repo"
    (repo / "unet").mkdir(parents=True)
    (repo / "vae").mkdir()
    unet = write_numpy(
        str(repo / "unet" / "diffusion_pytorch_model.safetensors"), {"conv.weight": np.ones(5, np.float32)}
    )
    vae = write_numpy(str(repo / "vae" / "diffusion_pytorch_model.safetensors"), {"dec.bias": np.arange(3.0)})
    write_sharded(str(repo / "text_encoder"), sharded_arrays())
    mnt = mount(str(repo))
    assert sorted(os.listdir(mnt)) == ["files", "text_encoder", "unet", "vae"]
    assert os.listdir(os.path.join(mnt, "text_encoder")) == ["model"]
    check_tensors(os.path.join(mnt, "unet", "diffusion_pytorch_model"), unet, ["conv.weight"])
    check_tensors(os.path.join(mnt, "vae", "diffusion_pytorch_model"), vae, ["dec.bias"])
    assert "index.json" in os.listdir(os.path.join(mnt, "text_encoder", "model"))


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_weird_names_each_reachable_at_one_path(mount, tmp_path, layout: str) -> None:  # noqa: ANN001
    arrays = {name: np.full(i + 1, i, dtype=np.uint8) for i, name in enumerate(WEIRD_NAMES)}
    source = write_numpy(str(tmp_path / "weird.safetensors"), arrays)
    mnt = mount(source, layout=layout)
    seen: dict[bytes, str] = {}
    for folder, _, files in os.walk(os.path.join(mnt, "tensors")):
        for file in files:
            path = os.path.join(folder, file)
            name = os.getxattr(path, "user.safetensors.name")
            assert name not in seen, (path, seen.get(name))
            seen[name] = path
            assert read_file(path) == tensor_bytes(source, name.decode())
    assert sorted(seen) == sorted(n.encode() for n in WEIRD_NAMES)
    check_tensors(mnt, source, WEIRD_NAMES, layout, paths={k.decode(): v for k, v in seen.items()})
    if layout == "nested":
        assert read_file(os.path.join(mnt, "tensors", "a", "b", "%")) == tensor_bytes(source, "a.b")
        assert read_file(os.path.join(mnt, "tensors", "x%2Fy")) == tensor_bytes(source, "x/y")
        assert read_file(os.path.join(mnt, "tensors", "%")) == tensor_bytes(source, "")
    if layout == "flat":
        assert sorted(os.listdir(os.path.join(mnt, "tensors"))) == sorted(split_name(n, "flat")[0] for n in WEIRD_NAMES)


def test_real_tools(mount, rich: str, tmp_path) -> None:  # noqa: ANN001
    mnt = mount(rich)
    name = "model.embed_tokens.weight"
    path = tensor_path(mnt, name)
    expected = tensor_bytes(rich, name)
    offset = int(os.getxattr(path, "user.safetensors.offset"))

    dd = run(["dd", f"if={path}", "bs=100", "skip=3", "count=5", "status=none"], text=False)
    assert dd.returncode == 0 and dd.stdout == expected[300:800]
    hexdump = run(["hexdump", "-C", "-n", "32", path])
    assert hexdump.stdout.splitlines()[0].startswith("00000000  " + " ".join(f"{b:02x}" for b in expected[:8]))
    extracted = tmp_path / "extracted"
    run(
        [
            "dd",
            f"if={rich}",
            f"of={extracted}",
            f"skip={offset}",
            f"count={len(expected)}",
            "iflag=skip_bytes,count_bytes",
            "status=none",
        ]
    )
    assert run(["cmp", path, str(extracted)]).returncode == 0
    assert run(["sha256sum", path]).stdout.split()[0] == hashlib.sha256(expected).hexdigest()

    copy = tmp_path / "copy"
    assert run(["cp", "-r", os.path.join(mnt, "tensors"), str(copy)]).returncode == 0
    for array_name in rich_arrays():
        assert read_file(os.path.join(str(copy), *split_name(array_name, "nested"))) == tensor_bytes(rich, array_name)

    jq = run(["jq", "-r", f'.["{name}"].dtype', os.path.join(mnt, "header.json")])
    assert jq.stdout.strip() == "F32"
    getfattr = run(["getfattr", "-n", "user.safetensors.shape", "--only-values", path])
    assert getfattr.stdout == "[64,16]"
    listing = run(["getfattr", "-d", path]).stdout
    for key in ("name", "dtype", "shape", "file", "offset"):
        assert f"user.safetensors.{key}=" in listing


MMAP_SUM = r"""
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
int main(int argc, char **argv) {
    int fd = open(argv[1], O_RDONLY);
    if (fd < 0) { perror("open"); return 1; }
    struct stat st; fstat(fd, &st);
    const float *values = mmap(NULL, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    if (values == MAP_FAILED) { perror("mmap"); return 1; }
    double sum = 0;
    for (size_t i = 0; i < st.st_size / sizeof(float); i++) sum += values[i];
    printf("%.6f\n", sum);
    return 0;
}
"""


def test_c_program_mmaps_and_sums(mount, rich: str, tmp_path) -> None:  # noqa: ANN001
    program = tmp_path / "mmap_sum"
    (tmp_path / "mmap_sum.c").write_text(MMAP_SUM)
    assert run(["gcc", "-O2", "-o", str(program), str(tmp_path / "mmap_sum.c")]).returncode == 0
    mnt = mount(rich)
    name = "model.embed_tokens.weight"
    result = run([str(program), tensor_path(mnt, name)])
    assert result.returncode == 0, result.stderr
    expected = np.frombuffer(tensor_bytes(rich, name), dtype=np.float32).astype(np.float64).sum()
    assert float(result.stdout) == pytest.approx(expected, abs=1e-3)


def test_numpy_memmap(mount, rich: str) -> None:  # noqa: ANN001
    mnt = mount(rich)
    array = np.memmap(tensor_path(mnt, "model.layers.0.mlp.up_proj.weight"), dtype=np.float16, mode="r", shape=(32, 16))
    assert np.array_equal(array, rich_arrays()["model.layers.0.mlp.up_proj.weight"])


MUTATIONS = {
    "write": lambda p: open(p, "wb"),  # noqa: SIM115
    "append": lambda p: open(p, "ab"),  # noqa: SIM115
    "read-write": lambda p: os.open(p, os.O_RDWR),
    "create": lambda p: open(os.path.join(os.path.dirname(p), "new"), "wb"),  # noqa: SIM115
    "mkdir": lambda p: os.mkdir(os.path.join(os.path.dirname(p), "newdir")),
    "rmdir": lambda p: os.rmdir(os.path.dirname(p)),
    "unlink": os.unlink,
    "rename": lambda p: os.rename(p, p + ".moved"),
    "chmod": lambda p: os.chmod(p, 0o644),
    "chown": lambda p: os.chown(p, 1, 1),
    "truncate": lambda p: os.truncate(p, 0),
    "utime": lambda p: os.utime(p, (0, 0)),
    "symlink": lambda p: os.symlink("/etc/passwd", os.path.join(os.path.dirname(p), "link")),
    "link": lambda p: os.link(p, os.path.join(os.path.dirname(p), "hard")),
    "setxattr": lambda p: os.setxattr(p, "user.x", b"1"),
    "removexattr": lambda p: os.removexattr(p, "user.safetensors.name"),
    "mknod": lambda p: os.mkfifo(os.path.join(os.path.dirname(p), "fifo")),
}


def test_every_mutation_fails_with_erofs(mount, rich: str) -> None:  # noqa: ANN001
    mnt = mount(rich)
    path = tensor_path(mnt, "model.embed_tokens.weight")
    before = read_file(path)
    for label, mutate in MUTATIONS.items():
        with pytest.raises(OSError) as caught:
            mutate(path)
        assert caught.value.errno == errno.EROFS, label
    assert read_file(path) == before
    assert os.listdir(os.path.dirname(path)) == ["weight"]


def test_errors_for_unknown_paths_and_folders(mount, rich: str) -> None:  # noqa: ANN001
    mnt = mount(rich)
    with pytest.raises(FileNotFoundError):
        os.stat(os.path.join(mnt, "tensors", "nope"))
    with pytest.raises(NotADirectoryError):
        open(os.path.join(mnt, "header.json", "x"), "rb")  # noqa: SIM115
    with pytest.raises(IsADirectoryError):
        read_file(os.path.join(mnt, "tensors"))
    fd = os.open(os.path.join(mnt, "tensors"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError) as caught:
            os.read(fd, 10)
        assert caught.value.errno == errno.EISDIR
    finally:
        os.close(fd)


def test_reads_at_any_offset_and_past_the_end(mount, rich: str) -> None:  # noqa: ANN001
    mnt = mount(rich)
    name = "model.embed_tokens.weight"
    expected = tensor_bytes(rich, name)
    fd = os.open(tensor_path(mnt, name), os.O_RDONLY)
    try:
        for offset, size in [(0, 1), (1, 7), (4095, 2), (len(expected) - 3, 100), (len(expected), 10), (10**9, 5)]:
            assert os.pread(fd, size, offset) == expected[offset : offset + size]
    finally:
        os.close(fd)


def test_eight_threads_of_random_preads(mount, rich: str) -> None:  # noqa: ANN001
    mnt = mount(rich)
    names = [n for n, a in rich_arrays().items() if a.nbytes > 0]
    expected = {n: tensor_bytes(rich, n) for n in names}
    failures: list[str] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        fds = {n: os.open(tensor_path(mnt, n), os.O_RDONLY) for n in names}
        try:
            for _ in range(400):
                name = rng.choice(names)
                data = expected[name]
                offset = rng.randrange(len(data))
                size = rng.randrange(1, 5000)
                if os.pread(fds[name], size, offset) != data[offset : offset + size]:
                    failures.append(f"{name}@{offset}+{size}")
        finally:
            for fd in fds.values():
                os.close(fd)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_attributes_statfs_and_stable_inodes(mount, rich: str) -> None:  # noqa: ANN001
    first = mount(rich)
    second = mount(rich)
    for relative in ("header.json", "tensors/model/embed_tokens/weight", "tensors/model/layers"):
        assert os.stat(os.path.join(first, relative)).st_ino == os.stat(os.path.join(second, relative)).st_ino
    walked = [os.stat(os.path.join(d, f)).st_ino for d, _, fs in os.walk(first) for f in fs]
    assert len(walked) == len(set(walked))
    data_size = sum(a.nbytes for a in rich_arrays().values())
    statvfs = os.statvfs(first)
    assert statvfs.f_blocks * statvfs.f_frsize >= data_size > (statvfs.f_blocks - 1) * statvfs.f_frsize
    du = run(["du", "-s", "--apparent-size", "-B1", os.path.join(first, "tensors")])
    assert int(du.stdout.split()[0]) >= data_size


def test_background_mount_and_unmount_commands(tmp_path, rich: str, require_fuse: None) -> None:  # noqa: ANN001
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log_file = tmp_path / "stfs.log"
    result = run(["stfs", "mount", rich, str(mnt), "--log-file", str(log_file)])
    try:
        assert result.returncode == 0, result.stderr
        assert os.path.ismount(mnt)  # ready when the command returns
        assert read_file(tensor_path(str(mnt), "scalar")) == tensor_bytes(rich, "scalar")
        again = run(["stfs", "mount", rich, str(mnt)])
        assert again.returncode == 1 and "already mounted" in again.stderr
    finally:
        unmounted = run(["stfs", "unmount", str(mnt)])
    assert unmounted.returncode == 0, unmounted.stderr
    assert not os.path.ismount(mnt)
    assert run(["stfs", "unmount", str(mnt)]).returncode == 1


def test_the_daemon_keeps_no_descriptor_its_starter_held(tmp_path, rich: str, require_fuse: None) -> None:  # noqa: ANN001
    """``flock LOCK stfs mount ...`` hands the lock's descriptor down: the daemon must not hold it while mounted."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    lock = tmp_path / "lock"
    result = run(["flock", str(lock), "stfs", "mount", rich, str(mnt)])
    try:
        assert result.returncode == 0, result.stderr
        pid = daemon_pid(str(mnt))
        assert pid
        held = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        assert str(lock) not in held
        assert run(["flock", "-n", str(lock), "true"]).returncode == 0, "the daemon still holds the lock"
        assert read_file(tensor_path(str(mnt), "scalar")) == tensor_bytes(rich, "scalar")
    finally:
        run(["stfs", "unmount", str(mnt)])
    assert not os.path.ismount(mnt)


def test_invalid_model_is_refused_and_nothing_mounted(tmp_path, require_fuse: None) -> None:  # noqa: ANN001
    bad = write_header(
        str(tmp_path / "bad.safetensors"), {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, data=b"\0" * 4
    )
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for extra in ([], ["-f"]):
        result = run(["stfs", "mount", bad, str(mnt), *extra])
        assert result.returncode == 1
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "bad.safetensors" in lines[0] and "'t'" in lines[0] and "rule 11" in lines[0]
        assert not os.path.ismount(mnt)


def test_bad_mountpoints(tmp_path, rich: str, require_fuse: None) -> None:  # noqa: ANN001
    missing = run(["stfs", "mount", rich, str(tmp_path / "missing")])
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    result = run(["stfs", "mount", rich, str(not_dir)])
    assert result.returncode == 1 and "not a directory" in result.stderr


def test_an_option_libfuse_refuses_is_its_one_line_and_nothing_mounted(
    tmp_path,
    rich: str,
    require_fuse: None,  # noqa: ANN001
) -> None:
    """An option libfuse knows with a value it refuses (an unknown one is a usage error before: test_options.py)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    refused = "libfuse refused the mount: "
    result = run(["stfs", "mount", rich, str(mnt), "-o", "ro,umask=xyz", "--log-file", str(tmp_path / "log")])
    assert result.returncode == 1 and not os.path.ismount(mnt)
    assert result.stderr.strip() == f"stfs: {mnt}: {refused}fuse: invalid parameter in option `umask=xyz'"
    # in the foreground libfuse says it on stderr itself, then stfs its line (it was a traceback ending in
    # "RuntimeError: libfuse could not mount ... (error the session has started)")
    result = run(["stfs", "mount", rich, str(mnt), "-f", "-o", "umask=xyz"])
    assert result.returncode == 1 and not os.path.ismount(mnt)
    assert result.stderr.strip().splitlines() == [
        "fuse: invalid parameter in option `umask=xyz'",
        f"stfs: {mnt}: {refused}it could not set up the session (libfuse's reason is above)",
    ]


@pytest.mark.parametrize("foreground", [[], ["-f"]])
def test_a_folder_that_is_not_empty_is_refused_unless_o_nonempty(
    tmp_path: Path, rich: str, require_fuse: None, foreground: list[str]
) -> None:
    """A mount would hide what the folder holds (libfuse 3 and mount(8) allow it silently); ``-o nonempty`` (or
    ``--nonempty``), as libfuse 2 and its users spell it, mounts all the same."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    (mnt / ".keep").write_text("x")
    stfs = [sys.executable, "-m", "stfs", "mount", rich, str(mnt), *foreground]
    result = run(stfs, cwd=REPO)
    assert (result.returncode, result.stderr) == (
        1,
        f"stfs: {mnt}: mountpoint is not empty (the mount would hide what it holds); empty it, or add -o nonempty\n",
    )
    assert not os.path.ismount(mnt)
    for spelling in (["-o", "nonempty"], ["--nonempty"]):
        result = run([*stfs[:6], *spelling, "--log-file", str(tmp_path / "log")], cwd=REPO)  # in the background
        try:
            assert (result.returncode, result.stderr) == (0, "")
            assert os.path.isdir(mnt / "tensors") and not (mnt / ".keep").exists()
        finally:
            run([sys.executable, "-m", "stfs", "unmount", str(mnt)], cwd=REPO)
        assert (mnt / ".keep").read_text() == "x"


def test_an_unmounted_daemon_ends_without_an_error(tmp_path, rich: str, require_fuse: None) -> None:  # noqa: ANN001
    mnt, log = tmp_path / "mnt", tmp_path / "log"
    mnt.mkdir()
    assert run(["stfs", "mount", rich, str(mnt), "--log-file", str(log)]).returncode == 0
    pid = daemon_pid(str(mnt))
    assert run(["stfs", "unmount", str(mnt)]).returncode == 0
    deadline = time.monotonic() + 10
    while pid is not None and os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    # the session's end raised "the session has started", logged as "stopped by signal the session has started"
    assert "stopped" not in log.read_text() and "ERROR" not in log.read_text(), log.read_text()


def test_python_context_manager(tmp_path, rich: str, require_fuse: None) -> None:  # noqa: ANN001
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with mounted(rich, str(mnt)) as root:
        assert read_file(os.path.join(root, "tensors", "scalar")) == tensor_bytes(rich, "scalar")
    assert not os.path.ismount(mnt)


@pytest.fixture
def foreground_daemon(tmp_path, rich: str, require_fuse: None) -> Iterator[tuple[subprocess.Popen, str]]:  # noqa: ANN001
    """``stfs mount -f`` in a child process, mounted; the test decides how it ends, teardown cleans up."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "stfs", "mount", rich, str(mnt), "-f"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            assert process.poll() is None and time.monotonic() < deadline, "the daemon did not mount"
            time.sleep(0.1)
        yield process, str(mnt)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        run(["fusermount3", "-u", "-z", str(mnt)])  # a no-op unless a failed test left it mounted or dead


def test_root_names_the_daemon_pid(foreground_daemon: tuple[subprocess.Popen, str]) -> None:
    process, mnt = foreground_daemon
    assert daemon_pid(mnt) == process.pid
    assert run(["getfattr", "-n", "user.stfs.pid", "--only-values", mnt]).stdout == str(process.pid)


def test_sigterm_unmounts_cleanly(foreground_daemon: tuple[subprocess.Popen, str]) -> None:
    process, mnt = foreground_daemon
    process.terminate()
    assert process.wait(timeout=30) == 0
    assert not os.path.ismount(mnt)


def test_sigkill_then_unmount_recovers(foreground_daemon: tuple[subprocess.Popen, str], rich: str) -> None:
    process, mnt = foreground_daemon
    process.kill()
    process.wait(timeout=30)
    with pytest.raises(OSError) as caught:
        os.listdir(mnt)
    assert caught.value.errno == errno.ENOTCONN
    again = run(["stfs", "mount", rich, mnt])
    assert again.returncode == 1 and "stfs unmount" in again.stderr
    assert run(["stfs", "unmount", mnt]).returncode == 0
    with mounted(rich, mnt):
        assert read_file(tensor_path(mnt, "scalar")) == tensor_bytes(rich, "scalar")


def test_truncated_source_gives_eio_and_mount_stays_up(mount, tmp_path) -> None:  # noqa: ANN001
    arrays = {"a": np.arange(40000, dtype=np.float32), "b": np.arange(40000, dtype=np.float32) * 2}
    source = write_numpy(str(tmp_path / "t.safetensors"), arrays)
    mnt = mount(source)
    os.truncate(source, os.path.getsize(source) - 100_000)
    for name in ("a", "b"):  # "a" lies before the new end, but the mounted version of the file is gone
        with pytest.raises(OSError) as caught:
            read_file(tensor_path(mnt, name))
        assert caught.value.errno == errno.EIO
    assert os.path.ismount(mnt) and sorted(os.listdir(os.path.join(mnt, "tensors"))) == ["a", "b"]
    assert json.loads(os.getxattr(mnt, "user.stfs.changed")) == [source]


def test_shutil_copytree_of_a_model(mount, rich: str, tmp_path) -> None:  # noqa: ANN001
    mnt = mount(rich)
    target = tmp_path / "tree"
    shutil.copytree(mnt, target)
    assert read_file(str(target / "header.json")) == raw_header(rich).rstrip(b" ")


def test_failed_reads_of_a_source_are_logged_once(tmp_path, require_fuse: None) -> None:  # noqa: ANN001
    arrays = {"a": np.arange(40000, dtype=np.float32), "b": np.arange(40000, dtype=np.float32) * 2}
    source = write_numpy(str(tmp_path / "t.safetensors"), arrays)
    mnt, log_file = tmp_path / "mnt", tmp_path / "daemon.log"
    mnt.mkdir()
    assert run(["stfs", "mount", source, str(mnt), "--log-file", str(log_file)]).returncode == 0
    try:
        os.truncate(source, os.path.getsize(source) - 100_000)
        for _ in range(5):
            fd = os.open(tensor_path(str(mnt), "b"), os.O_RDONLY)
            try:
                with pytest.raises(OSError) as caught:
                    os.pread(fd, 4096, 120_000)  # past the new end
                assert caught.value.errno == errno.EIO
            finally:
                os.close(fd)
    finally:
        assert run(["stfs", "unmount", str(mnt)]).returncode == 0
    errors = [line for line in log_file.read_text().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "t.safetensors" in errors[0], errors


def test_a_mountpoint_with_a_space_and_accents_is_found_in_the_mount_table(
    tmp_path,
    rich: str,
    require_fuse: None,  # noqa: ANN001
) -> None:
    """/proc/self/mountinfo spells a space ``\\040`` and keeps UTF-8 as it is: the mount's device (whose readahead the
    daemon tunes) is found at such a path; Python's ``unicode_escape`` had turned ``é`` into ``Ã©``."""
    from stfs.daemon import _mount_device, unescape_mountinfo

    assert unescape_mountinfo("/m\\040n/\\134é") == "/m n/\\é"
    mnt = tmp_path / "a b é"
    mnt.mkdir()
    with mounted(rich, str(mnt)):
        assert _mount_device(str(mnt)) == f"{os.major(os.stat(mnt).st_dev)}:{os.minor(os.stat(mnt).st_dev)}"
