"""Helpers the tests share: running real tools, whether FUSE is here, the mount function's type."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import select
import shutil
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

MountFn = Callable[..., str]


def fuse_available() -> bool:
    return os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None


def need_fuse() -> None:
    """Mount tests skip without /dev/fuse locally, but fail in CI (the ``require_fuse`` fixture, for any scope)."""
    if not fuse_available():
        if IN_CI:
            pytest.fail("/dev/fuse or fusermount3 is missing in CI")
        pytest.skip("FUSE is not available here")


def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
    """Run a real tool with a timeout; output as text unless ``text=False``."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("timeout", 60)
    return subprocess.run(command, **kwargs)  # type: ignore[call-overload]


def short_fuzz_run(script: str, out: Path, seconds: int, seed: int, *args: str) -> str:
    """``fuzz/SCRIPT`` for ``seconds`` from ``seed`` (findings kept in ``out``), which must end with none: its
    report."""
    command = [sys.executable, str(REPO / "fuzz" / script), "--seconds", str(seconds), "--seed", str(seed), *args]
    result = run([*command, "--out", str(out)], cwd=REPO, timeout=100 + seconds)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "findings: 0" in result.stdout, result.stdout
    return result.stdout


def refusal(source: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """``stfs mount SOURCE`` on a mountpoint under ``tmp_path``, expected to refuse: its result, once nothing is
    mounted there (nothing half-mounted)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir(exist_ok=True)
    result = run([sys.executable, "-m", "stfs", "mount", str(source), str(mnt)])
    assert not os.path.ismount(mnt)
    return result


def stfs_command(*args: str, **kwargs: object) -> subprocess.CompletedProcess:
    """The stfs command of this checkout, as a user runs it (``python -m stfs`` from the repository)."""
    kwargs.setdefault("timeout", 120)
    return run([sys.executable, "-m", "stfs", *args], cwd=REPO, **kwargs)


def rss_anon(pid: int) -> int:
    """The anonymous memory of process ``pid``, in bytes (``RssAnon`` of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as stream:
        for line in stream:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def peak_rss_anon_while(pid: int, work: Callable[[], object]) -> int:
    """Run ``work()``; the highest RssAnon of process ``pid`` meanwhile (sampled every 5 ms), in bytes."""
    peak = [rss_anon(pid)]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], rss_anon(pid))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], rss_anon(pid))


def dd_whole(path: str) -> None:
    """``dd bs=1M`` of ``path`` to /dev/null, which must copy every byte of it."""
    dd = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], capture_output=True, timeout=240)
    assert dd.returncode == 0, dd.stderr
    assert f"{os.path.getsize(path)} bytes".encode() in dd.stderr


def rss_memory(pid: int) -> int:
    """What process ``pid`` holds of memory, in bytes: ``RssAnon`` plus ``RssShmem`` (a memfd cache's pages)."""
    fields = {}
    with open(f"/proc/{pid}/status") as stream:
        for line in stream:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssShmem"):
                fields[name] = int(value.split()[0]) * 1024
    return fields["RssAnon"] + fields.get("RssShmem", 0)


def tensor_path(mnt: str, name: str) -> str:
    """The file of tensor ``name`` in a mount with the nested layout (a plain name: dots make folders)."""
    return os.path.join(mnt, "tensors", *name.split("."))


def read_cold(path: str, offset: int = 0, size: int = -1) -> bytes:
    """Read through the mount with its page cache dropped first, so the daemon answers (``size`` -1: to the end)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.fstat(fd).st_size - offset if size < 0 else size
        chunks = []
        while size > 0:
            chunk = os.pread(fd, min(size, 8 << 20), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
            size -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def changed(mnt: str) -> list[str]:
    """The mount root's ``user.stfs.changed``: the sources that no longer hold the mounted bytes."""
    return json.loads(os.getxattr(mnt, "user.stfs.changed"))


@contextlib.contextmanager
def served_by(
    command: list[str], mountpoint: Path, log_path: Path, env: dict[str, str] | None = None
) -> Iterator[None]:
    """A mount served by ``command``, a child process the test starts (a tree of its own through the real serve
    path): waited for until mounted (its log shown if it is not within 30 s); always unmounted, and the process
    reaped (killed if it has not ended 20 s after)."""
    from stfs.daemon import unmount

    with open(log_path, "w+") as log:
        server = subprocess.Popen(command, stdout=log, stderr=log, env=env)
        try:
            deadline = time.monotonic() + 30
            while not os.path.ismount(mountpoint):
                if server.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    pytest.fail(f"the server did not mount: {log.read()}")
                time.sleep(0.1)
            yield
        finally:
            if os.path.ismount(mountpoint):
                unmount(str(mountpoint))
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def read_pty(master: int, process: subprocess.Popen, timeout: float = 60) -> bytes:
    """Everything written to the terminal until ``process`` ends."""
    received = b""
    waiting = select.poll()  # not select(): a process that has opened a thousand files gets descriptors past 1023
    waiting.register(master, select.POLLIN)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if waiting.poll(100):
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the other end closed (EIO on Linux)
                break
            received += chunk
        elif process.poll() is not None:
            break
    return received


def on_a_terminal(*argv: str) -> tuple[int, bytes, str]:
    """The command with stderr on a pseudo-terminal: its exit code, what the terminal got, and its stdout."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal of 24 x 100
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "stfs", *argv],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=slave,
            stdin=subprocess.DEVNULL,
        )
        os.close(slave)
        received = read_pty(master, process)
        stdout = process.communicate(timeout=60)[0].decode()
    finally:
        os.close(master)
    return process.returncode, received, stdout
