"""Remote failures (SPEC §5, §7): whatever goes wrong reaching a source, ``stfs info``, ``check`` and ``mount`` print
one line that names the source and the cause, exit 1, and never a traceback; a certificate that does not verify
fails at once and says how to trust it; a token or password is never shown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import run
from tests.models import write_numpy
from tests.servers import BASIC_PASSWORD, BASIC_USER, LOCALHOST, S3, FakeHub, Nginx, free_port

pytestmark = pytest.mark.timeout(120)

SECRET = "hf_stfsErrorTestTokenNeverShown42"
COMMANDS = ("info", "check", "mount")


def one_line(command: str, source: str, tmp_path: Path, *extra: str, timeout: float = 60) -> str:
    """Run ``stfs COMMAND SOURCE`` (a mount in the background, as a user runs it); assert it failed with exit 1
    and one line, no traceback; that line."""
    argv = [sys.executable, "-m", "stfs", command, source, *extra]
    if command == "mount":  # one that should have been refused and was not is undone by conftest's fixture
        mnt = tmp_path / f"mnt-{len(list(tmp_path.glob('mnt-*')))}"
        mnt.mkdir()
        argv[5:5] = [str(mnt), "--log-file", str(tmp_path / "daemon.log")]
    result = run(argv, timeout=timeout)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 1, output
    assert "Traceback" not in output and len(output.splitlines()) == 1, output
    return output


def model_bytes(tmp_path: Path) -> bytes:
    path = tmp_path / "m.safetensors"
    write_numpy(str(path), {"w": np.arange(100, dtype=np.float32)})
    return path.read_bytes()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that takes connections (the kernel completes the handshake) and never answers a request."""
    with socket.create_server((LOCALHOST, 0), backlog=64) as listener:
        yield int(listener.getsockname()[1])


@pytest.mark.parametrize("command", COMMANDS)
def test_connection_refused(command: str, tmp_path: Path) -> None:
    source = f"http://{LOCALHOST}:{free_port()}/m.safetensors"
    # first contact: refused means nothing listens there, so it fails at once (a --timeout of 300 s never runs out)
    line = one_line(command, source, tmp_path, "--timeout", "300")
    assert source in line and "connection refused" in line


@pytest.mark.parametrize("command", COMMANDS)
def test_a_name_that_does_not_resolve(command: str, tmp_path: Path) -> None:
    source = "http://stfs-no-such-host.invalid/m.safetensors"  # .invalid never resolves (RFC 2606)
    line = one_line(command, source, tmp_path, "--timeout", "300")
    assert source in line and "does not resolve" in line


@pytest.mark.parametrize("command", COMMANDS)
def test_a_certificate_that_does_not_verify_fails_at_once(
    command: str, nginx: Nginx, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert nginx.https_url
    nginx.put("m.safetensors", model_bytes(tmp_path))
    for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):  # the system's CAs only
        monkeypatch.delenv(name, raising=False)
    source = f"{nginx.https_url}/m.safetensors"
    line = one_line(command, source, tmp_path, "--timeout", "300")  # retried, it would outlast run()'s 60 s
    assert source in line and "certificate" in line and "SSL_CERT_FILE" in line, line
    assert "UnknownIssuer" in line


@pytest.mark.parametrize("command", COMMANDS)
def test_a_hub_whose_certificate_does_not_verify(
    command: str, hub: FakeHub, nginx: Nginx, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert nginx.https_url
    for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", nginx.https_url)
    line = one_line(command, "hf://org/repo", tmp_path, "--timeout", "300")
    assert f"hf://org/repo@main: cannot reach {nginx.https_url}: the server's certificate does not verify" in line
    assert "SSL_CERT_FILE" in line, line


def test_the_same_certificate_trusted_through_ssl_cert_file(nginx: Nginx, tmp_path: Path) -> None:
    assert nginx.https_url
    nginx.put("m.safetensors", model_bytes(tmp_path))
    result = run([sys.executable, "-m", "stfs", "check", f"{nginx.https_url}/m.safetensors"])
    assert result.returncode == 0 and ": ok (1 tensors)" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_a_password_that_is_missing_or_wrong(command: str, nginx: Nginx, tmp_path: Path) -> None:
    nginx.put("private/m.safetensors", model_bytes(tmp_path))
    host = nginx.url.removeprefix("http://")
    for source in (
        f"{nginx.url}/private/m.safetensors",
        f"http://{BASIC_USER}:wrong-{BASIC_PASSWORD}@{host}/private/m.safetensors",
    ):
        line = one_line(command, source, tmp_path)
        assert f"{nginx.url}/private/m.safetensors" in line and "HTTP 401" in line and "credentials" in line
        assert BASIC_PASSWORD not in line


@pytest.mark.parametrize("command", COMMANDS)
def test_not_found(command: str, nginx: Nginx, tmp_path: Path) -> None:
    source = f"{nginx.url}/nope.safetensors"
    line = one_line(command, source, tmp_path)
    assert source in line and "no such file" in line


@pytest.mark.parametrize("command", COMMANDS)
def test_a_server_that_never_answers(command: str, silent_port: int, tmp_path: Path) -> None:
    source = f"http://{LOCALHOST}:{silent_port}/m.safetensors"
    line = one_line(command, source, tmp_path, "--timeout", "2")
    assert source in line and "gave up after 2 s" in line and "no answer" in line


@pytest.mark.parametrize("command", COMMANDS)
def test_the_hub_unreachable(command: str, hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = f"http://{LOCALHOST}:{free_port()}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    line = one_line(command, "hf://org/repo", tmp_path)
    assert line.endswith(
        f"hf://org/repo@main: cannot reach {endpoint}: connection refused (nothing listens at that address and port)"
    ), line


@pytest.mark.parametrize("command", COMMANDS)
def test_a_hub_that_never_answers(
    command: str, hub: FakeHub, silent_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://{LOCALHOST}:{silent_port}")
    line = one_line(command, "hf://org/repo", tmp_path, "--timeout", "2")
    assert "hf://org/repo@main: cannot reach" in line and "no answer" in line, line


@pytest.mark.parametrize("kind", ["private", "gated"])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_private_or_gated_repository_says_a_token_is_needed(
    command: str, kind: str, hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.publish_repo("org", "secret", {"model.safetensors": model_bytes(tmp_path)})
    hub.protect("org", "secret", SECRET, kind)
    line = one_line(command, "hf://org/secret", tmp_path)
    assert "hf://org/secret@main" in line and "a token" in line and "HF_TOKEN" in line, line
    if kind == "gated":
        assert "gated" in line
    if command != "info":
        return  # a wrong token, and the right one, once per kind
    monkeypatch.setenv("HF_TOKEN", SECRET + "-wrong")
    line = one_line(command, "hf://org/secret", tmp_path)
    assert "HF_TOKEN" in line and SECRET not in line, line
    monkeypatch.setenv("HF_TOKEN", SECRET)
    result = run([sys.executable, "-m", "stfs", "check", "hf://org/secret"])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_a_repository_the_hub_does_not_have(command: str, hub: FakeHub, tmp_path: Path) -> None:
    line = one_line(command, "hf://org/nothing-here", tmp_path)
    assert "hf://org/nothing-here@main: no such repository" in line, line


@pytest.mark.parametrize("command", COMMANDS)
def test_s3_without_the_bucket_or_the_server(
    command: str, s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = one_line(command, "s3://no-such-bucket/models/", tmp_path)
    assert line.endswith("s3://no-such-bucket/models/: no such bucket (HTTP 404)"), line
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{LOCALHOST}:{free_port()}")
    line = one_line(command, "s3://bucket/m.safetensors", tmp_path, "--timeout", "300")
    assert line.endswith("s3://bucket/m.safetensors: connection refused (nothing listens at that address and port)")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("http://127.0.0.1:abc/m.safetensors", "http://127.0.0.1:abc/m.safetensors: not a valid URL: the port is"),
        ("https://127.0.0.1:99999/m.safetensors", "https://127.0.0.1:99999/m.safetensors: not a valid URL: the port"),
        (f"http://{BASIC_USER}:{BASIC_PASSWORD}@[::1/m.safetensors?sig=abc", "http://[::1/m.safetensors: not a valid"),
        ("gs://bucket/m.safetensors", "gs://bucket/m.safetensors: not a source stfs reads (a local path, or an http"),
    ],
)
def test_a_url_stfs_cannot_read(command: str, source: str, expected: str, tmp_path: Path) -> None:
    line = one_line(command, source, tmp_path)
    assert line.startswith(f"stfs: {expected}") or line.startswith(expected), line  # check prints no "stfs: "
    assert BASIC_PASSWORD not in line and "sig=" not in line


def test_a_url_scheme_in_capitals_is_the_same_url(nginx: Nginx, tmp_path: Path) -> None:
    url = nginx.put("m.safetensors", model_bytes(tmp_path))
    result = run([sys.executable, "-m", "stfs", "check", "HTTP" + url.removeprefix("http")], timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"{url}: ok (1 tensors)", result


def test_a_local_path_shaped_like_a_url_is_a_path(tmp_path: Path) -> None:
    folder = tmp_path / "gs:" / "bucket"
    folder.mkdir(parents=True)
    (folder / "m.safetensors").write_bytes(model_bytes(tmp_path))
    result = run([sys.executable, "-m", "stfs", "check", "gs://bucket/m.safetensors"], timeout=60, cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip().endswith("gs:/bucket/m.safetensors: ok (1 tensors)"), result


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_of_a_plain_http_server(command: str, nginx: Nginx, tmp_path: Path) -> None:
    nginx.put("models/m.safetensors", model_bytes(tmp_path))
    folder = f"{nginx.url}/models/"
    line = one_line(command, folder, tmp_path)
    assert line.endswith(f"{folder}: this kind of server cannot list a folder; name a .safetensors file or an index")
    assert line.count(folder) == 1, line


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("variable", "value", "source"),
    [
        ("AWS_ENDPOINT_URL", "garbage", "s3://bucket/m.safetensors"),  # obstore panicked on these three
        ("AWS_ENDPOINT_URL", f"http://{LOCALHOST}:abc", "s3://bucket/m.safetensors"),
        ("AWS_ENDPOINT_URL_S3", "http://[::1", "s3://bucket/"),
        ("AWS_ENDPOINT_URL", "ftp://127.0.0.1", "s3://bucket/m.safetensors"),
        ("HF_ENDPOINT", f"http://{LOCALHOST}:abc", "hf://org/repo"),  # a traceback from urllib
        ("HF_ENDPOINT", "huggingface.co", "hf://org/repo"),
    ],
)
def test_an_endpoint_that_is_not_a_url(
    command: str, variable: str, value: str, source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "stfs-test")  # credentials at hand: nothing asks the instance first
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv(variable, value)
    line = one_line(command, source, tmp_path)
    assert line.endswith(f"{variable}={value}: not an http:// or https:// URL with a host and a valid port"), line
    assert SECRET not in line


@pytest.mark.parametrize("command", COMMANDS)
def test_a_repository_name_the_hub_cannot_have(command: str, hub: FakeHub, tmp_path: Path) -> None:
    line = one_line(command, "hf://org/re po", tmp_path)  # it said "cannot reach https://…: Repo id must use…"
    assert "hf://org/re po@main: Repo id must use alphanumeric chars" in line and "cannot reach" not in line, line


@pytest.mark.parametrize(
    ("url", "line"),
    [
        ("https:///m.safetensors", "https:///m.safetensors: not a valid URL: no host"),
        (f"http://{LOCALHOST}:abc/m.safetensors", f"http://{LOCALHOST}:abc/m.safetensors: not a valid URL: the port"),
        (f"http://{BASIC_USER}:{BASIC_PASSWORD}@[::1/m.safetensors", "http://[::1/m.safetensors: not a valid URL"),
    ],
)
def test_a_url_that_does_not_parse_is_refused_by_the_source_itself(url: str, line: str) -> None:
    from stfs import errors
    from stfs.sources.urls import open_remote

    with pytest.raises(errors.SourceError) as refused:  # what a caller of open_source gets, no request made
        open_remote(url)
    assert refused.value.message.startswith(line) and BASIC_PASSWORD not in refused.value.message


@pytest.mark.parametrize(("folder", "reason"), [("a-file", "Not a directory"), ("/proc", "")])  # /proc: nothing made
def test_a_cache_dir_that_cannot_hold_a_cache(folder: str, reason: str, nginx: Nginx, tmp_path: Path) -> None:
    (nginx.root / "m.safetensors").write_bytes(model_bytes(tmp_path))
    (tmp_path / "a-file").write_text("not a folder\n")
    cache_dir = folder if folder.startswith("/") else str(tmp_path / folder)
    line = one_line("mount", f"{nginx.url}/m.safetensors", tmp_path, "--cache-dir", cache_dir)
    assert line.startswith(f"stfs: {cache_dir}: cannot keep a cache there: {reason}"), line
    assert not os.path.ismount(tmp_path / "mnt-0")  # refused before anything was mounted, not at the first read


@pytest.fixture
def silent_listener() -> Iterator[socket.socket]:
    """A listening socket that takes connections and never answers: ``accept()`` tells a client has come."""
    with socket.create_server((LOCALHOST, 0), backlog=64) as listener:
        listener.settimeout(60)
        yield listener


def daemons_of(mountpoint: Path) -> list[int]:
    """PIDs of the processes whose command line names ``mountpoint``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if str(mountpoint).encode() in Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0"):
                    found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.mark.parametrize("argv", [["info"], ["check"], ["mount"], ["mount", "-f"]], ids=" ".join)
def test_ctrl_c_while_the_server_never_answers_stops_at_once(
    argv: list[str], silent_listener: socket.socket, tmp_path: Path
) -> None:
    """Ctrl-C while the first request waits (in obstore's Rust code, where Python runs no handler) ends the command
    then, not after --timeout; a mount that was not made leaves no daemon behind to make it later."""
    url = f"http://{LOCALHOST}:{silent_listener.getsockname()[1]}/m.safetensors"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    extra = [str(mnt), "--log-file", str(tmp_path / "daemon.log")] if argv[0] == "mount" else []
    command = [sys.executable, "-m", "stfs", argv[0], *argv[1:], url, *extra, "--timeout", "600"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        connection, _ = silent_listener.accept()  # stfs (its daemon, for a mount) is connected: its request waits
        with connection:
            time.sleep(0.5)  # the request sent: it waits on an answer, in Rust
            process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=30)  # before the change: --timeout's 600 s
    finally:
        process.kill()
        process.wait()
    assert process.returncode in (130, -signal.SIGINT), err
    assert "Traceback" not in err
    assert not os.path.ismount(mnt)
    deadline = time.monotonic() + 10
    while daemons_of(mnt) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemons_of(mnt) == []
