"""HTTPS bodies read by stfs._tls (stfs.sources.tls) from nginx's TLS port and a TLS fault proxy on 127.0.0.1:
byte-exact, the kept-alive connection used again, a body cut short or stalled failing as Python's ssl fails, and
Python's ssl reading wherever stfs._tls cannot; a mount over HTTPS serves the source's bytes either way, to many
readers at once within its memory bound.

Which path read a body shows in its ``progress`` pieces: stfs._tls leaves the body's last byte to http.client (so
that it ends the response itself), Python's ssl reads ``SLICE`` after ``SLICE`` to the end."""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stfs.daemon import daemon_pid
from stfs.sources import tls
from stfs.sources.http_client import SLICE, HttpClient, https_context
from tests.helpers import IN_CI, MountFn, read_cold, rss_memory, tensor_path
from tests.models import tensor_bytes
from tests.remote_helpers import MIB, big_model, publish_nginx
from tests.servers import FaultProxy, Nginx, TlsFiles

pytestmark = pytest.mark.timeout(60)

SKIP = 1000  # the ranges start inside the file


@pytest.fixture
def https(nginx: Nginx) -> str:
    for missing, what in ((nginx.https_url is None, "TLS (cryptography)"), (not tls.AVAILABLE, "stfs._tls")):
        if missing:
            pytest.fail(f"{what} is missing in CI") if IN_CI else pytest.skip(f"{what} is not available here")
    assert nginx.https_url is not None
    return nginx.https_url


def _read(client: HttpClient, lo: int, size: int) -> tuple[bytes, list[int]]:
    pieces: list[int] = []
    into = memoryview(bytearray(size))
    client.get_into("blob", lo, into, progress=pieces.append)
    return bytes(into), pieces


@pytest.mark.parametrize("size", [SLICE + 1, 3 * MIB + 4321, 8 * MIB])
def test_a_tls_body_is_read_by_stfs_tls_and_the_connection_is_kept(size: int, nginx: Nginx, https: str) -> None:
    data = os.urandom(SKIP + size)
    nginx.put("blob", data)
    client = HttpClient(https, {}, timeout=3.0)
    try:
        body, pieces = _read(client, SKIP, size)
        assert body == data[SKIP:]
        assert pieces[-1] == 1 and sum(pieces) == size  # stfs._tls read it (a slice, then the rest if it came fast)
        small, _ = _read(client, 5, 10)  # http.client ended the response: the connection takes another request
        assert small == data[5:15]
    finally:
        client.close()
    entries = nginx.log.entries(at_least=2)  # nginx logs a request a moment after its response
    assert len(entries) == 2 and entries[0].connection == entries[1].connection


def test_ranges_read_by_many_threads_over_tls_are_exact(nginx: Nginx, https: str) -> None:
    """stfs._tls reads ahead of the records it hands over (128 KiB a read()): whatever it read ahead of one response
    stays with its connection, and the next response on that connection starts where it should."""
    data = os.urandom(24 * MIB)
    nginx.put("blob", data)
    rng = random.Random(53)
    ranges = [
        (rng.randrange(len(data) - 4 * MIB), rng.choice([9, SLICE - 1, SLICE + 1, 3 * MIB + 17])) for _ in range(40)
    ]
    client = HttpClient(https, {}, timeout=10.0)
    try:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda lo_size: _read(client, *lo_size)[0], ranges))
    finally:
        client.close()
    assert all(body == data[lo : lo + size] for (lo, size), body in zip(ranges, got, strict=True))
    assert 0 < len({entry.connection for entry in nginx.log.entries(at_least=40)}) <= 8  # connections kept


def test_python_ssl_reads_where_stfs_tls_is_off(nginx: Nginx, https: str, monkeypatch: pytest.MonkeyPatch) -> None:
    size = 3 * MIB + 4321
    data = os.urandom(SKIP + size)
    nginx.put("blob", data)
    monkeypatch.setattr(tls, "AVAILABLE", False)  # as without the extension, or with STFS_NATIVE=0
    client = HttpClient(https, {}, timeout=3.0)
    try:
        body, pieces = _read(client, SKIP, size)
    finally:
        client.close()
    assert body == data[SKIP:]
    assert pieces[-1] == size % SLICE  # SLICE after SLICE through Python's ssl


def test_stfs_tls_reads_only_the_ssl_object_python_says_is_there(nginx: Nginx, https: str) -> None:
    """The fields C takes the SSL object from are checked against the socket, its context and its descriptor;
    anything else is refused before OpenSSL is called."""
    from stfs import _tls  # type: ignore[attr-defined]

    nginx.put("blob", b"x" * 10)
    port = int(https.rpartition(":")[2])
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=ssl.create_default_context(), timeout=3)
    try:
        connection.connect()
        sock = connection.sock
        assert isinstance(sock, ssl.SSLSocket)
        sslobj, fd = sock._sslobj, sock.fileno()  # type: ignore[attr-defined]
        assert _tls.usable(sslobj, sock, sock.context, fd)
        assert tls.reader(sock) is not None
        assert not _tls.usable(sslobj, sock, ssl.create_default_context(), fd)  # another context
        assert not _tls.usable(sslobj, sock, sock.context, fd + 100)  # another descriptor
        assert not _tls.usable(sslobj, object(), sock.context, fd)  # another socket
        assert not _tls.usable(sock.context, sock, sock.context, fd)  # not an SSL socket at all
        with pytest.raises(ValueError):
            _tls.read_into(sslobj, object(), sock.context, fd, bytearray(10), 1.0)
    finally:
        connection.close()
    with socket.create_connection(("127.0.0.1", port)) as plain:
        assert tls.reader(plain) is None
    assert tls.reader(None) is None


def test_https_clients_share_one_context_per_ca_store(
    https: str, tls_files: TlsFiles | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Making a context loads the CA store (tens of ms): every client of the process shares one, and another
    ``SSL_CERT_FILE`` gets its own."""
    assert tls_files is not None
    first, second = HttpClient(https, {}, timeout=3.0), HttpClient("https://localhost:1", {}, timeout=3.0)
    assert first._context is not None and first._context is second._context is https_context()
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_files.ca))
    assert https_context() is not first._context and https_context() is https_context()


@pytest.mark.parametrize("fault", ["cut short", "stalled"])
def test_a_tls_body_failing_midway_fails_and_the_next_comes_whole(
    fault: str, nginx: Nginx, https: str, fault_proxy: Callable[..., FaultProxy], tls_files: TlsFiles | None
) -> None:
    """A body cut by a reset fails at once (the client's timeout is longer than the test may take: a wait fails
    it); one that stalls fails with ``TimeoutError`` after the client's timeout. The next request, on a new
    connection, is whole."""
    data = os.urandom(8 * MIB)
    nginx.put("blob", data)
    assert tls_files is not None
    proxy = fault_proxy(nginx.url, tls_files)
    if fault == "cut short":
        proxy.reset_next(1, after_bytes=3 * MIB)
        client, error = HttpClient(proxy.url, {}, timeout=120.0), OSError
    else:
        proxy.stall_next(1, after_bytes=3 * MIB, seconds=30)
        client, error = HttpClient(proxy.url, {}, timeout=1.0), TimeoutError
    try:
        with pytest.raises(error):
            _read(client, 0, 8 * MIB)
        proxy.clear_faults()
        body, pieces = _read(client, 0, 8 * MIB)
        assert body == data and pieces[-1] == 1
    finally:
        client.close()


@pytest.mark.parametrize("native", ["1", "0"])
def test_an_https_mount_serves_the_source_bytes(
    native: str, nginx: Nginx, https: str, mount: MountFn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dd``/``cmp`` of every tensor and of ``files/`` over HTTPS, bodies read by stfs._tls and (STFS_NATIVE=0)
    by Python's ssl."""
    monkeypatch.setenv("STFS_NATIVE", native)
    source = big_model(tmp_path / "m" / "model.safetensors", tensors=3, tensor_bytes=3 * MIB + 4321)
    base = publish_nginx(nginx, source.parent, "models/m").replace(nginx.url, https)
    mnt = mount(f"{base}/model.safetensors")
    raw = source.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    for index in range(3):  # before files/: each tensor's bytes fetched by its own reads
        path = f"{mnt}/tensors/layers/{index}/weight"
        lo, hi = (8 + length + offset for offset in header[f"layers.{index}.weight"]["data_offsets"])
        read = subprocess.run(["dd", f"if={path}", "bs=1M", "status=none"], capture_output=True, check=True).stdout
        assert read == raw[lo:hi], path
    assert subprocess.run(["cmp", source, f"{mnt}/files/model.safetensors"]).returncode == 0


def test_a_slow_tls_link_reports_its_bytes_slice_by_slice(
    nginx: Nginx, https: str, fault_proxy: Callable[..., FaultProxy], tls_files: TlsFiles | None
) -> None:
    """stfs._tls reads the rest of a body in one call only where its first slice came fast enough for the whole to
    come well within the timeout; over a slower link it goes on a slice a call, each reported to ``progress``."""
    size = 2 * MIB + 4321
    data = os.urandom(SKIP + size)
    nginx.put("blob", data)
    assert tls_files is not None
    proxy = fault_proxy(nginx.url, tls_files)
    proxy.set_rate(MIB)  # 2 MiB take 2 s, over an eighth of the 4 s timeout
    client = HttpClient(proxy.url, {}, timeout=4.0)
    try:
        body, pieces = _read(client, SKIP, size)
    finally:
        client.close()
    assert body == data[SKIP:]
    assert pieces[-1] == 1 and max(pieces) <= SLICE and sum(pieces) == size


def test_an_https_mount_under_concurrent_readers_is_exact_within_its_memory_bound(
    nginx: Nginx, https: str, mount: MountFn, tmp_path: Path
) -> None:
    """Four threads reading tensors (each from its page cache dropped) and a ``cmp`` of ``files/`` at once, over
    HTTPS with a 16 MiB cache: 64 MiB of random bytes through slots reused again and again, each body read ahead by
    OpenSSL; every byte exact, and the daemon's RssAnon + RssShmem under the cache plus 150 MiB throughout."""
    tensors = 8
    source = big_model(tmp_path / "m" / "model.safetensors", tensors=tensors, tensor_bytes=8 * MIB + 777, seed=53)
    base = publish_nginx(nginx, source.parent, "models/c").replace(nginx.url, https)
    mnt = mount(f"{base}/model.safetensors", options=["cache_size=16M"])
    pid = daemon_pid(mnt)
    assert pid
    names = [f"layers.{i}.weight" for i in range(tensors)]
    expected = {name: tensor_bytes(str(source), name) for name in names}
    peak = [rss_memory(pid)]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak.append(rss_memory(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        compare = subprocess.Popen(["cmp", source, f"{mnt}/files/model.safetensors"])
        with ThreadPoolExecutor(4) as pool:
            order = [names[(i * 3) % tensors] for i in range(2 * tensors)]  # each tensor twice, out of order
            for name, got in zip(order, pool.map(lambda n: read_cold(tensor_path(mnt, n)), order), strict=True):
                assert got == expected[name], name
        assert compare.wait(timeout=60) == 0
    finally:
        done.set()
        sampler.join(5)
    assert max(peak) < (16 + 150) * MIB, f"RssAnon + RssShmem peaked at {max(peak) / MIB:.0f} MiB"
