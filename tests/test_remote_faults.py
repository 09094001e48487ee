"""Faults of a remote source (SPEC §6, §7): resets, 5xx, 429 and latency are retried; a stalled or failing
server gives EIO within --timeout and the mount serves again once it is back; a replaced object gives EIO (or,
where the old version stays readable, its old bytes), never new bytes, and ``user.stfs.changed`` names it."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from stfs.daemon import daemon_pid, is_dead_mount
from stfs.sources.retries import attempts_within
from tests.helpers import MountFn, changed, read_cold, run, tensor_path
from tests.models import tensor_bytes, write_numpy, write_sharded
from tests.remote_helpers import MIB, wait_for, walk
from tests.servers import S3, FakeHub, FaultProxy, Nginx

pytestmark = pytest.mark.timeout(120)

TENSORS = 6
SIZE = 2 * MIB + 4321


def arrays(version: int) -> dict[str, np.ndarray]:
    """Same names, shapes and dtypes for every version (so the same header), other values."""
    rng = np.random.default_rng(version)
    return {f"layers.{i}.weight": rng.integers(0, 256, SIZE, dtype=np.uint8) for i in range(TENSORS)}


def model_bytes(tmp_path: Path, version: int) -> tuple[bytes, dict[str, bytes]]:
    path = tmp_path / f"v{version}.safetensors"
    write_numpy(str(path), arrays(version))
    return path.read_bytes(), {name: tensor_bytes(str(path), name) for name in arrays(version)}


def read_outcome(path: str, old: bytes, new: bytes | None = None) -> str:
    """``"old"`` or ``"eio"``; new bytes, or any other error, fail the test."""
    try:
        data = read_cold(path)
    except OSError as exc:
        assert exc.errno == errno.EIO, exc
        return "eio"
    assert data != new, f"{path}: the new version's bytes"
    assert data == old, f"{path}: bytes of no version"
    return "old"


def read_in_thread(path: str, deadline: float = 30.0) -> bytes | OSError:
    """A cold read on a thread, waited for up to ``deadline`` s (a read that hangs fails the test)."""
    outcome: list[bytes | OSError] = []

    def target() -> None:
        try:
            outcome.append(read_cold(path))
        except OSError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(deadline)
    assert outcome, f"{path}: a read still hangs after {deadline} s"
    return outcome[0]


@pytest.fixture
def proxied(nginx: Nginx, fault_proxy: Callable[[str], FaultProxy], tmp_path: Path) -> tuple[FaultProxy, str, dict]:
    data, tensors = model_bytes(tmp_path, 1)
    nginx.put("m.safetensors", data)
    proxy = fault_proxy(nginx.url)
    return proxy, f"{proxy.url}/m.safetensors", tensors


# --- transient faults -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["reset", "503", "429", "latency", "503-at-mount"])
def test_reads_succeed_through_transient_faults(fault: str, proxied: tuple, mount: MountFn) -> None:
    proxy, url, tensors = proxied
    if fault == "503-at-mount":
        proxy.fail_next(3, status=503)
    mnt = mount(url, options=["timeout=20"])
    if fault == "reset":
        proxy.reset_next(3, after_bytes=100_000)
    elif fault in ("503", "429"):
        proxy.fail_next(4, status=int(fault), retry_after=0)
    elif fault == "latency":
        proxy.set_latency(0.05)
    for name, data in tensors.items():
        assert read_cold(tensor_path(mnt, name)) == data, name
    stats = proxy.stats()
    if fault == "reset":
        assert stats.resets == 3
    elif fault == "latency":  # every request after the mount's first read (fetches cross tensors: fewer than them)
        assert stats.delayed == stats.requests - 1 >= 2
    else:
        assert stats.failed >= 3


@pytest.mark.parametrize("where", ["http", "hub", "s3", "s3-versioned"])
def test_a_slow_link_is_not_a_stalled_one(
    where: str,
    nginx: Nginx,
    fault_proxy: Callable[[str], FaultProxy],
    mount: MountFn,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bytes that keep coming, only slowly (400 KB/s: a tensor's 2 MiB take longer than ``--timeout 2``), are a slow
    link, not a stalled server: the read waits for them and gets the tensor. Over HTTP stfs's client reads the
    body (with the socket's low-water mark at 1 MiB on a fast link, never on this one), from the Hub's CDN and from
    S3's presigned URLs too; a versioned S3 object through obstore's GETs, each sized to come whole within the
    timeout."""
    data, tensors = model_bytes(tmp_path, 1)
    if where == "http":
        nginx.put("m.safetensors", data)
        proxy = fault_proxy(nginx.url)
        source = f"{proxy.url}/m.safetensors"
    elif where == "hub":
        hub: FakeHub = request.getfixturevalue("hub")
        hub.publish_repo("org", "repo", {"model.safetensors": data})
        proxy = fault_proxy(hub.nginx.cdn_url)
        hub.nginx.set_redirect_base(proxy.url)
        source = "hf://org/repo"
    else:
        s3: S3 = request.getfixturevalue("s3")
        s3.create_bucket("bucket", versioned=where == "s3-versioned")
        s3.put_object("bucket", "m.safetensors", data)
        proxy = fault_proxy(s3.endpoint)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        source = "s3://bucket/m.safetensors"
    proxy.set_rate(400_000)  # slow from the start: obstore's first GETs (versioned) are sized from the first read
    mnt = mount(source, options=["timeout=2"])
    assert read_in_thread(tensor_path(mnt, "layers.1.weight"), deadline=60) == tensors["layers.1.weight"]


def test_a_stalled_server_gives_eio_within_the_timeout_then_the_mount_recovers(proxied: tuple, mount: MountFn) -> None:
    proxy, url, tensors = proxied
    mnt = mount(url, options=["timeout=3"])
    proxy.stall_next(1000, after_bytes=0, seconds=60)
    failed = read_in_thread(tensor_path(mnt, "layers.1.weight"))
    assert isinstance(failed, OSError) and failed.errno == errno.EIO
    assert proxy.stats().stalls >= 1
    proxy.clear_faults()  # the server is back (the stalled answers stay stalled: their requests time out)
    assert read_in_thread(tensor_path(mnt, "layers.1.weight")) == tensors["layers.1.weight"]
    assert os.path.ismount(mnt) and daemon_pid(mnt)


def test_a_server_that_keeps_failing_gives_eio_then_the_mount_recovers(proxied: tuple, mount: MountFn) -> None:
    proxy, url, tensors = proxied
    mnt = mount(url, options=["timeout=3"])
    proxy.fail_next(1_000_000, status=503)
    failed = read_in_thread(tensor_path(mnt, "layers.2.weight"))
    assert isinstance(failed, OSError) and failed.errno == errno.EIO
    assert proxy.stats().failed > 1  # retried before giving up
    proxy.clear_faults()
    for name, data in tensors.items():
        assert read_cold(tensor_path(mnt, name)) == data


def test_a_read_of_a_failing_server_waits_out_one_timeout_not_two(proxied: tuple, mount: MountFn) -> None:
    """One deadline per read, from when it began: the kernel asks again for the first page of a read that failed
    (its readahead failed, it reads the page itself), and that second ask is the same read. Counted as the requests
    the server saw: no more than one run of retries, within --timeout, can make (a slow machine makes fewer)."""
    proxy, url, _ = proxied
    mnt = mount(url, options=["timeout=4"])
    proxy.fail_next(1_000_000, status=503)
    failed = read_in_thread(tensor_path(mnt, "layers.1.weight"))  # one block: no fetch ahead beside the read's
    assert isinstance(failed, OSError) and failed.errno == errno.EIO
    assert 1 < proxy.stats().failed <= attempts_within(4.0)


def test_a_killed_server_on_this_machine_fails_a_read_fast(proxied: tuple, mount: MountFn) -> None:
    """Connection refused on a loopback host: nothing will listen there soon, so a read fails after a couple of
    quick retries rather than retrying for --timeout (60 s here; the read would still hang when waited for)."""
    proxy, url, _ = proxied
    mnt = mount(url, options=["timeout=60"])
    proxy.stop()  # the server killed: its port refuses connections
    failed = read_in_thread(tensor_path(mnt, "layers.1.weight"), deadline=20)
    assert isinstance(failed, OSError) and failed.errno == errno.EIO
    assert os.path.ismount(mnt) and daemon_pid(mnt)


def test_unmount_is_not_held_up_by_a_wedged_fetch(proxied: tuple, tmp_path: Path) -> None:
    proxy, url, tensors = proxied
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    command = [
        sys.executable,
        "-m",
        "stfs",
        "mount",
        url,
        str(mnt),
        "--timeout",
        "3",
        "--log-file",
        str(tmp_path / "l"),
    ]
    assert run(command).returncode == 0
    pid = daemon_pid(str(mnt))
    try:
        assert pid
        proxy.stall_next(1000, after_bytes=0, seconds=60)
        failed = read_in_thread(tensor_path(str(mnt), "layers.3.weight"))
        assert isinstance(failed, OSError) and failed.errno == errno.EIO
        # fetches of the window are still stalled in the daemon: unmount does not wait for them
        result = run([sys.executable, "-m", "stfs", "unmount", str(mnt)], timeout=30)
        assert result.returncode == 0, result.stderr
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 20, "the daemon's exit")
    finally:
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_does_not_wait_out_the_retries(proxied: tuple, tmp_path: Path, signum: int) -> None:
    """SIGTERM or SIGINT while a read retries against a server that keeps failing: the daemon gives the retries up
    and exits, where it used to wait out --timeout (600 s here)."""
    proxy, url, _ = proxied
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = tmp_path / "stfs.log"
    assert (
        run(
            [sys.executable, "-m", "stfs", "mount", url, str(mnt), "--timeout", "600", "--log-file", str(log)]
        ).returncode
        == 0
    )
    pid = daemon_pid(str(mnt))
    reader = None
    try:
        assert pid
        proxy.fail_next(1_000_000, status=503)
        reader = subprocess.Popen(["cat", tensor_path(str(mnt), "layers.2.weight")], stdout=subprocess.DEVNULL)
        wait_for(lambda: proxy.stats().failed >= 2, 30, "the read's retries")
        os.kill(pid, signum)
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 30, "the daemon's exit")
        assert reader.wait(timeout=30) != 0
    finally:
        if pid and os.path.exists(f"/proc/{pid}"):  # first: a read the daemon holds cannot be killed
            os.kill(pid, signal.SIGKILL)  # our own daemon, by PID: it would retry for 600 s
        if reader is not None and reader.poll() is None:
            reader.kill()
            reader.wait()
        if os.path.ismount(mnt) or is_dead_mount(str(mnt)):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
    assert "given up, the mount is stopping" in log.read_text()


# --- an object replaced under the mount ------------------------------------------------------------------


def test_an_http_object_replaced_gives_eio_never_new_bytes(nginx: Nginx, mount: MountFn, tmp_path: Path) -> None:
    old_data, old = model_bytes(tmp_path, 1)
    new_data, new = model_bytes(tmp_path, 2)
    url = nginx.put("m.safetensors", old_data)
    mnt = mount(url)
    assert read_cold(tensor_path(mnt, "layers.0.weight")) == old["layers.0.weight"]
    nginx.log.clear()
    assert changed(mnt) == []
    [head] = nginx.log.entries(at_least=1)  # one request per source when the xattr is read
    assert head.method == "HEAD" and head.uri == "/m.safetensors"
    nginx.replace("m.safetensors", new_data)
    nginx.log.clear()
    assert len(walk_names(mnt)) > TENSORS  # ls, stat, getxattr of every file: nothing asks the server
    assert nginx.log.entries(timeout=0.5) == []
    outcomes = {name: read_outcome(tensor_path(mnt, name), old[name], new[name]) for name in old}
    assert outcomes["layers.5.weight"] == "eio"  # never fetched before: the 412 says it changed
    with pytest.raises(OSError) as raised:
        read_cold(os.path.join(mnt, "files", "m.safetensors"))
    assert raised.value.errno == errno.EIO
    assert changed(mnt) == [url]
    assert all(entry.status in (412, 200) for entry in nginx.log.entries())  # never a 206 of the new object


def walk_names(mnt: str) -> list[str]:
    names = []
    for folder, dirs, files in os.walk(mnt):
        for name in dirs + files:
            path = os.path.join(folder, name)
            os.stat(path)
            for attr in os.listxattr(path):
                os.getxattr(path, attr)
            names.append(path)
    return names


def test_changed_asks_once_per_source_and_names_a_replaced_index(nginx: Nginx, mount: MountFn, tmp_path: Path) -> None:
    index = Path(
        write_sharded(str(tmp_path / "set"), {f"s{i}.safetensors": {f"t{i}": np.arange(10)} for i in range(3)})
    )
    for path in index.parent.iterdir():
        nginx.put(f"set/{path.name}", path.read_bytes())
    mnt = mount(f"{nginx.url}/set/{index.name}")
    nginx.log.clear()
    assert changed(mnt) == []
    entries = nginx.log.entries(at_least=4)
    assert sorted(e.uri for e in entries) == sorted(
        f"/set/{name}" for name in [index.name, *(f"s{i}.safetensors" for i in range(3))]
    )
    assert all(e.method == "HEAD" for e in entries)
    nginx.replace(f"set/{index.name}", index.read_bytes() + b"\n")
    assert changed(mnt) == [f"{nginx.url}/set/{index.name}"]


@pytest.mark.parametrize("versioned", [False, True], ids=["unversioned", "versioned"])
def test_an_s3_object_put_over(versioned: bool, s3: S3, mount: MountFn, tmp_path: Path) -> None:
    old_data, old = model_bytes(tmp_path, 1)
    new_data, new = model_bytes(tmp_path, 2)
    s3.create_bucket("bucket", versioned=versioned)
    s3.put_object("bucket", "m/x.safetensors", old_data)
    mnt = mount("s3://bucket/m/x.safetensors")
    assert read_cold(tensor_path(mnt, "layers.0.weight")) == old["layers.0.weight"]
    assert changed(mnt) == []
    s3.put_object("bucket", "m/x.safetensors", new_data)
    outcomes = {name: read_outcome(tensor_path(mnt, name), old[name], new[name]) for name in old}
    if versioned:  # the pinned VersionId still reads: the old bytes, all of them
        assert set(outcomes.values()) == {"old"}
    else:
        assert outcomes["layers.5.weight"] == "eio"
    assert changed(mnt) == ["s3://bucket/m/x.safetensors"]


def test_a_new_commit_on_the_hub(hub: FakeHub, mount: MountFn, tmp_path: Path) -> None:
    old_data, old = model_bytes(tmp_path, 1)
    new_data, new = model_bytes(tmp_path, 2)
    commit = hub.publish_repo("org", "repo", {"model.safetensors": old_data, "config.json": b"{}"})
    mnt = mount("hf://org/repo")
    assert read_cold(tensor_path(mnt, "layers.0.weight")) == old["layers.0.weight"]
    assert changed(mnt) == []
    hub.publish_repo("org", "repo", {"model.safetensors": new_data, "config.json": b"{}"})
    # pinned to its commit, which the Hub still serves: the old bytes, never the new commit's
    *names, last = sorted(old)  # read last to first: a reader in file order would fetch ahead into ``last``
    outcomes = {name: read_outcome(tensor_path(mnt, name), old[name], new[name]) for name in reversed(names)}
    assert set(outcomes.values()) == {"old"}
    # main no longer holds the mounted model.safetensors; config.json is the same file in the new commit
    assert changed(mnt) == [f"hf://org/repo@{commit}/model.safetensors"]
    # the commit itself gone (history rewritten): EIO for what was never fetched
    os.unlink(hub.nginx.cdn_root / "org" / "repo" / commit / "model.safetensors")
    assert read_outcome(tensor_path(mnt, last), old[last], new[last]) == "eio"


def test_every_read_after_mounting_is_ranged_and_conditional(nginx: Nginx, mount: MountFn, tmp_path: Path) -> None:
    old_data, _ = model_bytes(tmp_path, 1)
    url = nginx.put("m.safetensors", old_data)
    mnt = mount(url)
    nginx.log.clear()
    entries = walk(mnt)  # reads every file: headers come from the first read, tensors are fetched
    assert len(entries) > TENSORS
    logged = nginx.log.entries(at_least=1)
    assert logged and all(e.range and e.if_match for e in logged)
