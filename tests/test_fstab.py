"""Where FUSE filesystems live: ``mount -t fuse.stfs``, an fstab line, ``umount`` leaving no daemon, and every stfs
setting spelled as an ``-o`` item, all mounted for real.

mount(8) clears PATH before it runs mount.fuse3, whose shell then finds ``stfs`` only in /bin/sh's default PATH
(/usr/local/sbin first). So the mount(8) tests run in a private mount namespace of their own in which
/usr/local/sbin holds an ``stfs`` that runs this checkout; the machine's /usr/local/sbin is not touched.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from stfs.daemon import daemon_pid, unmount
from stfs.errors import MountError
from tests.helpers import IN_CI, MountFn, run
from tests.models import rich_arrays, write_header, write_numpy, write_sharded

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
FIRST_ON_DEFAULT_PATH = "/usr/local/sbin"
DEADLINE = 30.0


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie waiting for init to reap it has)."""
    try:
        with open(f"/proc/{pid}/stat") as stream:
            return stream.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float = DEADLINE) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def end_daemon(pid: int | None) -> None:
    """Teardown: a daemon this test started must not outlive it; SIGTERM unmounts, SIGKILL if that fails."""
    if pid is None or wait_gone(pid, timeout=5):
        return
    for signum in (signal.SIGTERM, signal.SIGKILL):
        os.kill(pid, signum)
        if wait_gone(pid, timeout=10):
            return


def data_start(path: str) -> int:
    """Where tensor data begins in a safetensors file: 8 + header length, read without stfs."""
    with open(path, "rb") as stream:
        return 8 + struct.unpack("<Q", stream.read(8))[0]


def header_of(path: str) -> dict:
    with open(path, "rb") as stream:
        return json.loads(stream.read(data_start(path))[8:])


class Namespace:
    """A private mount namespace (held open by one process) where mount(8) finds an ``stfs`` running this checkout."""

    def __init__(self, holder: subprocess.Popen) -> None:
        self.holder = holder
        self.inherited: set[str] = set()  # copies of the host's mounts: never this test's to unmount

    def run(self, *command: str, **kwargs: object) -> subprocess.CompletedProcess:
        # Entering a mount namespace resets the working directory to its root: every path here is absolute.
        return run(["nsenter", f"--target={self.holder.pid}", "--mount", "--", *command], **kwargs)

    def mounts(self) -> dict[str, tuple[str, str]]:
        """Mountpoint -> (type, options) of every mount in the namespace, from its mountinfo."""
        found = {}
        with open(f"/proc/{self.holder.pid}/mountinfo") as stream:
            for line in stream:
                fields = line.split()
                separator = fields.index("-")
                found[fields[4]] = (fields[separator + 1], fields[5])
        return found

    def daemon_pid(self, mountpoint: str) -> int | None:
        result = self.run("getfattr", "-n", "user.stfs.pid", "--only-values", mountpoint)
        return int(result.stdout) if result.returncode == 0 and result.stdout.isdigit() else None

    def close(self) -> None:
        """Unmount every stfs mount this test left in the namespace, end its daemon, then let the namespace go."""
        for mountpoint, (fstype, _) in self.mounts().items():
            if fstype == "fuse.stfs" and mountpoint not in self.inherited:
                pid = self.daemon_pid(mountpoint)
                if self.run("umount", mountpoint).returncode != 0:
                    self.run("umount", "-l", mountpoint)
                end_daemon(pid)
        assert self.holder.stdin is not None
        self.holder.stdin.close()
        self.holder.wait(timeout=10)


@pytest.fixture
def namespace(tmp_path: Path, require_fuse: None) -> Iterator[Namespace]:
    missing = [tool for tool in ("unshare", "nsenter", "mount.fuse3", "getfattr") if shutil.which(tool) is None]
    if os.getuid() != 0 or missing:
        reason = f"mount(8) tests need root and {', '.join(missing) or 'nothing else'}"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    programs = tmp_path / "bin"
    programs.mkdir()
    wrapper = programs / "stfs"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m stfs "$@"\n')
    wrapper.chmod(0o755)
    holder = subprocess.Popen(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"mount --bind {programs} {FIRST_ON_DEFAULT_PATH} && echo ready && exec cat",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    namespace = Namespace(holder)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n", "no private mount namespace"
        namespace.inherited = set(namespace.mounts())
        yield namespace
    finally:
        namespace.close()


@pytest.fixture
def model(tmp_path: Path) -> str:
    return write_numpy(str(tmp_path / "model.safetensors"), rich_arrays(), metadata={"format": "np"})


def mountpoint(tmp_path: Path, name: str = "mnt") -> str:
    path = tmp_path / name
    path.mkdir()
    return str(path)


def assert_tensor_served(namespace: Namespace, mnt: str, source: str, name: str, path: str) -> None:
    """The file at ``path`` holds tensor ``name``'s bytes, compared by cmp with the source at its offset."""
    begin, end = header_of(source)[name]["data_offsets"]
    assert namespace.run("stat", "-c", "%s", path).stdout.strip() == str(end - begin)
    result = namespace.run("cmp", "-n", str(end - begin), path, source, "0", str(data_start(source) + begin))
    assert result.returncode == 0, result.stdout + result.stderr


def assert_umount_ends_daemon(namespace: Namespace, mnt: str) -> None:
    pid = namespace.daemon_pid(mnt)
    assert pid is not None
    result = namespace.run("umount", mnt)
    assert result.returncode == 0, result.stderr
    assert mnt not in namespace.mounts()
    assert wait_gone(pid), f"daemon {pid} still running after umount"


def test_mount_t_fuse_stfs_then_umount(namespace: Namespace, model: str, tmp_path: Path) -> None:
    mnt = mountpoint(tmp_path)
    result = namespace.run("mount", "-t", "fuse.stfs", model, mnt, "-o", "ro")
    assert result.returncode == 0, result.stderr
    assert result.stdout == result.stderr == ""
    fstype, options = namespace.mounts()[mnt]
    assert fstype == "fuse.stfs" and options.split(",")[:3] == ["ro", "nosuid", "nodev"]
    assert namespace.run("ls", mnt).stdout.split() == ["files", "header.json", "metadata", "tensors"]
    assert namespace.run("ls", f"{mnt}/tensors/model/layers/0/mlp/up_proj").stdout.split() == ["bias", "weight"]
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.bias", "counts.u64"):
        assert_tensor_served(namespace, mnt, model, name, f"{mnt}/tensors/{name.replace('.', '/')}")
    assert_umount_ends_daemon(namespace, mnt)


def test_an_fstab_line(namespace: Namespace, tmp_path: Path) -> None:
    folder = tmp_path / "qwen"
    index = write_sharded(
        str(folder),
        {
            "model-00001-of-00002.safetensors": {"a.w": np.arange(9, dtype=np.int16)},
            "model-00002-of-00002.safetensors": {"b.w": np.ones((2, 3), np.float32)},
        },
    )
    mnt = mountpoint(tmp_path)
    log = tmp_path / "stfs.log"
    fstab = tmp_path / "fstab"
    options = f"ro,allow_other,nofail,x-systemd.automount,layout=flat,log_file={log}"
    fstab.write_text(f"# what an administrator writes in /etc/fstab\n{folder} {mnt} fuse.stfs {options} 0 0\n")
    result = namespace.run("mount", "-T", str(fstab), mnt)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    fstype, _ = namespace.mounts()[mnt]
    assert fstype == "fuse.stfs"
    assert namespace.run("ls", f"{mnt}/tensors").stdout.split() == ["a.w", "b.w"]
    assert namespace.run("cmp", f"{mnt}/index.json", index).returncode == 0
    for name, shard in (("a.w", "model-00001-of-00002.safetensors"), ("b.w", "model-00002-of-00002.safetensors")):
        assert_tensor_served(namespace, mnt, str(folder / shard), name, f"{mnt}/tensors/{name}")
    other = namespace.run("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "ls", f"{mnt}/tensors")
    assert other.returncode != 0 and "Permission denied" in other.stderr  # tmp_path is 0700; the mount is not
    assert "allow_other" in namespace.run("findmnt", "-n", "-o", "OPTIONS", mnt).stdout
    assert f"serving {folder} at {mnt}" in log.read_text()
    assert_umount_ends_daemon(namespace, mnt)


def test_without_ro_the_mount_is_read_only_all_the_same(namespace: Namespace, model: str, tmp_path: Path) -> None:
    mnt = mountpoint(tmp_path)
    result = namespace.run("mount", "-t", "fuse.stfs", model, mnt)  # mount(8) passes rw,dev,suid
    assert result.returncode == 0, result.stderr
    assert result.stderr == "stfs: warning: -o rw: stfs mounts are read-only; mounting read-only\n"
    assert namespace.mounts()[mnt][1].startswith("ro,")
    touched = namespace.run("touch", f"{mnt}/tensors/new")
    assert touched.returncode != 0 and "Read-only file system" in touched.stderr
    assert_umount_ends_daemon(namespace, mnt)


def test_an_invalid_model_is_one_line_and_nothing_mounted(namespace: Namespace, tmp_path: Path) -> None:
    bad = write_header(
        str(tmp_path / "bad.safetensors"), {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, data=b"\0" * 4
    )
    mnt = mountpoint(tmp_path)
    result = namespace.run("mount", "-t", "fuse.stfs", bad, mnt, "-o", "ro")
    assert result.returncode != 0
    [line] = result.stderr.splitlines()
    assert line.startswith(f"stfs: {bad}: tensor 't': rule 11")
    assert mnt not in namespace.mounts()


# -- stfs's own settings as -o items, through `stfs SOURCE MNT -o ...` (the command line mount.fuse3 runs) ----------


@pytest.fixture
def background(require_fuse: None) -> Iterator[Callable[..., subprocess.CompletedProcess]]:
    """``background(source, mnt, options)`` runs ``stfs SOURCE MNT -o OPTIONS``; teardown unmounts, daemon ends."""
    mounted: list[str] = []

    def start(source: str, mnt: str, options: str) -> subprocess.CompletedProcess:
        mounted.append(mnt)
        return run([sys.executable, "-m", "stfs", source, mnt, "-o", options])

    yield start
    for mnt in mounted:
        if os.path.ismount(mnt):
            pid = daemon_pid(mnt)
            try:
                unmount(mnt)
            except MountError:
                unmount(mnt, lazy=True)
            end_daemon(pid)


def tasks(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_o_layout_and_log_file(
    background: Callable[..., subprocess.CompletedProcess], model: str, tmp_path: Path
) -> None:
    mnt = mountpoint(tmp_path)
    log = tmp_path / "daemon.log"
    result = background(model, mnt, f"ro,dev,suid,layout=flat,log_file={log}")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert sorted(os.listdir(f"{mnt}/tensors")) == sorted(rich_arrays())
    assert f"serving {model} at {mnt}" in log.read_text()
    pid = daemon_pid(mnt)
    assert pid is not None
    unmount(mnt)
    assert wait_gone(pid)


def test_o_threads(background: Callable[..., subprocess.CompletedProcess], model: str, tmp_path: Path) -> None:
    counts = {}
    for options in ("ro", "ro,threads"):
        mnt = mountpoint(tmp_path, options.replace(",", "-"))
        assert background(model, mnt, options).returncode == 0
        pid = daemon_pid(mnt)
        assert pid is not None
        with open(f"{mnt}/tensors/scalar", "rb") as stream:
            stream.read()
        deadline = time.monotonic() + DEADLINE
        while tasks(pid) > 1 and options == "ro" and time.monotonic() < deadline:
            time.sleep(0.05)  # the thread that reported readiness is on its way out
        counts[options] = tasks(pid)
    assert counts["ro"] == 1 and counts["ro,threads"] > 1, counts


def test_o_max_open_files(background: Callable[..., subprocess.CompletedProcess], tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    sources = {
        f"m{k}": write_numpy(str(folder / f"m{k}.safetensors"), {"w": np.full(1000, k, np.int32)}) for k in range(3)
    }
    mnt = mountpoint(tmp_path)
    assert background(str(folder), mnt, "max_open_files=1").returncode == 0
    pid = daemon_pid(mnt)
    for name in sources:
        with open(f"{mnt}/{name}/tensors/w", "rb") as stream:
            assert stream.read() == np.full(1000, int(name[1:]), np.int32).tobytes()
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        assert len([link for link in links if link in sources.values()]) <= 1, links


@pytest.mark.skipif(shutil.which("fincore") is None, reason="fincore (util-linux) is not installed")
def test_o_keep_source_cache(mount: MountFn, tmp_path: Path) -> None:
    source = write_numpy(str(tmp_path / "big.safetensors"), {"w": np.ones(4 << 20, np.float32)})  # 16 MiB
    resident = {}
    for options in ([], ["keep_source_cache"]):
        with open(source, "rb") as stream:
            os.fsync(stream.fileno())
            os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        mnt = mount(source, options=options)
        with open(f"{mnt}/tensors/w", "rb") as stream:
            while stream.read(1 << 20):
                pass
        fincore = run(["fincore", "--bytes", "--noheadings", "--output", "RES", source])
        resident[bool(options)] = int(fincore.stdout.split()[0])
    assert resident[True] >= 16 << 20 > 4 * resident[False], resident


def test_o_direct_io_as_readme_says(mount: MountFn, tmp_path: Path) -> None:
    """libfuse's ``-o direct_io`` passes through: the bytes are the source's (``cmp``), a private ``mmap`` works and
    a shared one fails with ENODEV, as docs/choices.md says."""
    source = write_numpy(str(tmp_path / "m.safetensors"), {"w": np.arange(1 << 20, dtype=np.float32)})
    mnt = mount(source, options=["direct_io"])
    served = os.path.join(mnt, "files", "m.safetensors")
    assert run(["cmp", served, source]).returncode == 0
    with open(os.path.join(mnt, "tensors", "w"), "rb") as stream:
        assert stream.read() == np.arange(1 << 20, dtype=np.float32).tobytes()
    fd = os.open(served, os.O_RDONLY)
    try:
        with mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ) as mapped:
            assert mapped[:] == Path(source).read_bytes()
        with pytest.raises(OSError) as raised:
            mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        assert raised.value.errno == errno.ENODEV
    finally:
        os.close(fd)
