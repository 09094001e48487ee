"""Secrets (SPEC §7): a URL's password, HF_TOKEN and AWS keys are used, and never appear in the daemon's log,
xattrs, header.json, error messages or /proc/PID/cmdline."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stfs.daemon import daemon_pid
from tests.helpers import changed, read_cold, run
from tests.models import tensor_bytes, write_numpy
from tests.servers import BASIC_PASSWORD, BASIC_USER, S3, SIGNATURE, SIGNED_QUERY, FakeHub, Nginx

pytestmark = pytest.mark.timeout(120)

HF_SECRET = "hf_stfsTestTokenNeverShown0123456789"
AWS_KEY_ID = "AKIASTFSTESTNEVERSHOWN"
AWS_SECRET = "stfs/Test+Secret/Key/NeverShown0123456789"


def model(path: Path, version: int = 1) -> bytes:
    rng = np.random.default_rng(version)
    write_numpy(str(path), {f"layers.{i}.weight": rng.integers(0, 256, 300_000, dtype=np.uint8) for i in range(4)})
    return path.read_bytes()


@contextlib.contextmanager
def background_mount(source: str, mnt: Path, log: Path) -> Iterator[int]:
    """``stfs mount SOURCE MNT`` as a user runs it (the daemon in the background); the daemon's PID."""
    mnt.mkdir()
    result = run([sys.executable, "-m", "stfs", "mount", source, str(mnt), "--log-file", str(log), "--timeout", "5"])
    assert result.returncode == 0, result.stderr
    assert not any(secret in result.stderr + result.stdout for secret in (BASIC_PASSWORD, HF_SECRET, AWS_SECRET))
    pid = daemon_pid(str(mnt))
    assert pid
    try:
        yield pid
    finally:
        if os.path.ismount(mnt):
            subprocess.run([sys.executable, "-m", "stfs", "unmount", str(mnt)], capture_output=True, timeout=30)
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)


def header_json_clean(mnt: Path, secrets: list[str]) -> None:
    header = (mnt / "header.json").read_bytes()
    assert header.startswith(b"{") and not any(s.encode() in header for s in secrets)


def assert_nowhere(secrets: list[str], mnt: Path, pid: int, log: Path) -> None:
    """Not in any xattr, the daemon's log, or its command line."""
    for folder, dirs, files in os.walk(mnt):
        for name in dirs + files:
            path = os.path.join(folder, name)
            for attr in os.listxattr(path):
                assert not any(s.encode() in os.getxattr(path, attr) for s in secrets), (path, attr)
    text = log.read_text()
    assert text and not any(s in text for s in secrets)
    with open(f"/proc/{pid}/cmdline", "rb") as stream:
        cmdline = stream.read()
    assert b"stfs" in cmdline and not any(s.encode() in cmdline for s in secrets)


def test_a_url_password(nginx: Nginx, tmp_path: Path) -> None:
    data = model(tmp_path / "m.safetensors")
    nginx.put("private/m.safetensors", data)
    host = nginx.url.removeprefix("http://")
    url = f"http://{BASIC_USER}:{BASIC_PASSWORD}@{host}/private/m.safetensors"
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    with background_mount(url, mnt, log) as pid:
        assert os.getxattr(mnt / "tensors" / "layers" / "0" / "weight", "user.safetensors.file").decode() == (
            f"{nginx.url}/private/m.safetensors"
        )
        with open(mnt / "files" / "m.safetensors", "rb") as stream:
            assert stream.read(1000) == data[:1000]
        header_json_clean(mnt, [BASIC_PASSWORD])
        nginx.replace("private/m.safetensors", model(tmp_path / "new.safetensors", 2))
        with pytest.raises(OSError):  # a failure the daemon logs, with the URL
            read_cold(str(mnt / "files" / "m.safetensors"))
        assert changed(mnt) == [f"{nginx.url}/private/m.safetensors"]
        assert_nowhere([BASIC_PASSWORD], mnt, pid, log)
        assert "changed since it was mounted" in log.read_text()
    entries = nginx.log.entries(at_least=2)
    assert all(e.authorization.startswith("Basic ") and e.status != 401 for e in entries)  # the password was used
    # errors name the URL without its password
    for wrong in (url.replace(".safetensors", "-missing.safetensors"), url.replace(BASIC_PASSWORD, "wrong-" + "x")):
        for command in (["info", wrong], ["check", wrong]):
            result = run([sys.executable, "-m", "stfs", *command])
            assert result.returncode == 1 and BASIC_PASSWORD not in result.stdout + result.stderr
            assert f"{nginx.url}/private/" in result.stdout + result.stderr
    result = run([sys.executable, "-m", "stfs", "mount", "-f", url.replace(".safetensors", "-x.safetensors"), str(mnt)])
    assert result.returncode == 1 and BASIC_PASSWORD not in result.stderr


def test_hf_token(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", HF_SECRET)
    data = model(tmp_path / "m.safetensors")
    commit = hub.publish_repo("org", "repo", {"model.safetensors": data, "config.json": b"{}"})
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    with background_mount("hf://org/repo", mnt, log) as pid:
        with open(mnt / "files" / "model.safetensors", "rb") as stream:
            assert stream.read(1000) == data[:1000]
        header_json_clean(mnt, [HF_SECRET])
        assert changed(mnt) == []
        os.unlink(hub.nginx.cdn_root / "org" / "repo" / commit / "model.safetensors")  # a failure the daemon logs
        with pytest.raises(OSError):
            read_cold(str(mnt / "files" / "model.safetensors"))
        assert_nowhere([HF_SECRET], mnt, pid, log)
    resolves = [e for e in hub.log.entries(at_least=1) if "/resolve/" in e.uri]
    assert resolves and all(e.authorization == f"Bearer {HF_SECRET}" for e in resolves)  # the token was used
    cdn = hub.cdn_log.entries(at_least=1)
    assert cdn and all(e.authorization == "" for e in cdn)  # and not carried to the CDN's host
    result = run([sys.executable, "-m", "stfs", "info", "hf://org/missing"])
    assert result.returncode == 1 and HF_SECRET not in result.stdout + result.stderr


def test_aws_keys(s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", AWS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    data = model(tmp_path / "m.safetensors")
    s3.create_bucket("bucket")
    s3.put_object("bucket", "m.safetensors", data)
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    with background_mount("s3://bucket/m.safetensors", mnt, log) as pid:
        with open(mnt / "files" / "m.safetensors", "rb") as stream:
            assert stream.read(1000) == data[:1000]
        header_json_clean(mnt, [AWS_SECRET, AWS_KEY_ID])
        s3.put_object("bucket", "m.safetensors", model(tmp_path / "new.safetensors", 2))
        with pytest.raises(OSError):
            read_cold(str(mnt / "files" / "m.safetensors"))
        assert changed(mnt) == ["s3://bucket/m.safetensors"]
        assert_nowhere([AWS_SECRET, AWS_KEY_ID], mnt, pid, log)
    result = run([sys.executable, "-m", "stfs", "info", "s3://bucket/missing.safetensors"])
    assert result.returncode == 1 and AWS_SECRET not in result.stdout + result.stderr


def test_a_presigned_url(nginx: Nginx, tmp_path: Path) -> None:
    """Its query goes with every request, is never shown (xattrs, header.json, log, cmdline, mount table, errors),
    and once the server refuses it (expired) reads fail with EIO after one log line, asking nothing more."""
    rng = np.random.default_rng(5)  # tensors of 4 MiB: reading one never reads ahead into layers 2 and 3
    write_numpy(
        str(tmp_path / "m.safetensors"),
        {f"layers.{i}.weight": rng.integers(0, 256, 4 << 20, dtype=np.uint8) for i in range(4)},
    )
    data = (tmp_path / "m.safetensors").read_bytes()
    nginx.put("signed/m.safetensors", data)
    plain = f"{nginx.url}/signed/m.safetensors"
    url = f"{plain}?{SIGNED_QUERY}"
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    with background_mount(url, mnt, log) as pid:
        weight = mnt / "tensors" / "layers" / "0" / "weight"
        assert os.getxattr(weight, "user.safetensors.file").decode() == plain
        with open(mnt / "files" / "m.safetensors", "rb") as stream:
            assert stream.read(1000) == data[:1000]
        assert read_cold(str(weight)) == tensor_bytes(str(tmp_path / "m.safetensors"), "layers.0.weight")
        header_json_clean(mnt, [SIGNATURE])
        with open("/proc/self/mountinfo") as stream:
            [line] = [line for line in stream if f" {mnt} " in line]
        assert plain in line and SIGNATURE not in line
        entries = nginx.log.entries(at_least=2)
        assert entries and all(SIGNATURE in e.uri and e.status in (200, 206) for e in entries)  # the query every time

        nginx.log.clear()
        nginx.expire_signatures()
        for name in ("layers/2/weight", "layers/3/weight"):
            with pytest.raises(OSError) as failure:
                read_cold(str(mnt / "tensors" / name))
            assert failure.value.errno == errno.EIO
        assert len(nginx.log.entries()) <= 4  # the reads' own fetches: no retries, none once it is known expired
        assert_nowhere([SIGNATURE], mnt, pid, log)
        lines = [line for line in log.read_text().splitlines() if "presigned URL" in line]
        assert len(lines) == 1 and "expired" in lines[0] and plain.removeprefix("http://").split("/")[0] in lines[0]
        nginx.expire_signatures(False)
        assert os.path.ismount(mnt)
    # refused from the start, or without its query: one line, no secret
    for wrong in (url.replace(SIGNATURE, "wrong" + SIGNATURE[5:]), plain):
        result = run([sys.executable, "-m", "stfs", "info", wrong])
        assert result.returncode == 1 and SIGNATURE not in result.stdout + result.stderr
        assert "403" in result.stderr and len(result.stderr.strip().splitlines()) == 1
