"""The test servers themselves, driven by plain clients: what the remote tests rely on them to do."""

from __future__ import annotations

import http.client
import socket
import ssl
import urllib.request
from collections.abc import Callable

import pytest

from tests.servers import S3, FakeHub, FaultProxy, Nginx, http_get

BODY = bytes(range(256)) * 256  # 64 KiB, every byte position distinguishable modulo 256


def test_nginx_range_get_is_206_and_the_log_counts_its_bytes(nginx: Nginx) -> None:
    url = nginx.put("models/x.safetensors", BODY)
    status, headers, body = http_get(url, {"Range": "bytes=1000-1099", "Accept-Encoding": "gzip"})
    assert (status, body) == (206, BODY[1000:1100])
    assert headers["content-range"] == f"bytes 1000-1099/{len(BODY)}"
    assert headers["etag"].startswith('"') and "content-encoding" not in headers
    [entry] = nginx.log.entries(at_least=1)
    assert (entry.method, entry.uri, entry.status) == ("GET", "/models/x.safetensors", 206)
    assert (entry.range, entry.body_bytes) == ("bytes=1000-1099", 100)
    assert entry.bytes > entry.body_bytes  # the head counts in $bytes_sent
    assert nginx.log.transfer().bytes == 100
    nginx.log.clear()
    assert nginx.log.entries() == []


def test_nginx_replace_serves_new_bytes_under_a_new_etag(nginx: Nginx) -> None:
    url = nginx.put("x.bin", BODY)
    _, before, _ = http_get(url)
    nginx.replace("x.bin", BODY[::-1])  # same size, same second
    _, after, body = http_get(url)
    assert body == BODY[::-1] and after["etag"] != before["etag"]


def test_nginx_https_is_trusted_through_ssl_cert_file(nginx: Nginx) -> None:
    if nginx.https_url is None:
        pytest.skip("no cryptography: no TLS")
    nginx.put("x.bin", BODY)
    request = urllib.request.Request(f"{nginx.https_url}/x.bin", headers={"Range": "bytes=-10"})
    with urllib.request.urlopen(request, context=ssl.create_default_context(), timeout=5) as response:
        assert (response.status, response.read()) == (206, BODY[-10:])
    assert nginx.log.entries(at_least=1)[0].scheme == "https"


@pytest.fixture
def hf_repo(hub: FakeHub) -> tuple[str, dict[str, bytes]]:
    files = {"model.safetensors": BODY, "config.json": b"{}", "sub/tokenizer.json": b'{"a": 1}'}
    return hub.publish_repo("org", "repo", files), files


def test_hub_resolves_main_to_its_commit_and_lists_the_repo(hub: FakeHub, hf_repo: tuple[str, dict]) -> None:
    from huggingface_hub import HfApi

    commit, files = hf_repo
    api = HfApi(endpoint=hub.endpoint)
    assert api.model_info("org/repo", revision="main").sha == commit
    assert api.model_info("org/repo", revision=commit).sha == commit
    assert sorted(api.list_repo_files("org/repo")) == sorted(files)
    assert sorted(api.list_repo_files("org/repo", revision=commit)) == sorted(files)
    uris = [entry.uri for entry in hub.log.entries(at_least=4)]
    assert "/api/models/org/repo/revision/main" in uris
    assert any(uri.startswith("/api/models/org/repo/tree/main?recursive=true") for uri in uris)


def test_hub_download_follows_the_redirect_without_the_token(hub: FakeHub, hf_repo: tuple[str, dict]) -> None:
    from huggingface_hub import hf_hub_download

    commit, files = hf_repo
    path = hf_hub_download("org/repo", "model.safetensors", endpoint=hub.endpoint, token="hf_test_secret")
    with open(path, "rb") as stream:
        assert stream.read() == files["model.safetensors"]
    [head] = [e for e in hub.log.entries(at_least=1) if "/resolve/" in e.uri]
    assert (head.method, head.status, head.authorization) == ("HEAD", 302, "Bearer hf_test_secret")
    [get] = hub.cdn_log.entries(at_least=1)
    assert get.uri == f"/org/repo/{commit}/model.safetensors" and get.authorization == ""


def test_hub_range_get_through_the_302(hub: FakeHub, hf_repo: tuple[str, dict]) -> None:
    commit, files = hf_repo
    status, headers, _ = http_get(hub.resolve_url("org", "repo", "model.safetensors"))
    assert status == 302 and headers["location"].startswith(hub.nginx.cdn_url)
    assert headers["x-repo-commit"] == commit
    assert headers["x-linked-size"] == str(len(BODY))
    assert len(headers["x-linked-etag"]) == 66  # a quoted sha256: the file is in LFS
    for revision in ("main", commit):
        request = urllib.request.Request(
            hub.resolve_url("org", "repo", "model.safetensors", revision), headers={"Range": "bytes=10-19"}
        )
        with urllib.request.urlopen(request, timeout=5) as response:  # urllib follows the 302
            assert (response.status, response.read()) == (206, BODY[10:20])
    assert [e.status for e in hub.cdn_log.entries(at_least=2)] == [206, 206]
    assert http_get(hub.resolve_url("org", "repo", "missing.bin"))[0] == 404


def test_hub_new_commit_moves_the_branch_and_keeps_the_old_one(hub: FakeHub, hf_repo: tuple[str, dict]) -> None:
    old, _ = hf_repo
    new = hub.publish_repo("org", "repo", {"model.safetensors": b"new"})
    assert new != old
    assert http_get(hub.resolve_url("org", "repo", "model.safetensors"))[1]["x-repo-commit"] == new
    assert http_get(hub.resolve_url("org", "repo", "config.json"))[0] == 404
    assert http_get(hub.resolve_url("org", "repo", "config.json", old))[1]["x-repo-commit"] == old


def test_moto_ranged_get_and_versions(s3: S3) -> None:
    s3.create_bucket("plain")
    put = s3.put_object("plain", "m/x.safetensors", BODY)
    answer = s3.get_object("plain", "m/x.safetensors", byte_range="bytes=100-199")
    assert answer["Body"].read() == BODY[100:200] and answer["ContentRange"] == f"bytes 100-199/{len(BODY)}"
    assert answer["ETag"] == put.etag and put.version_id is None
    s3.create_bucket("versioned", versioned=True)
    first = s3.put_object("versioned", "x", b"one")
    second = s3.put_object("versioned", "x", b"two")
    assert first.version_id and second.version_id and first.version_id != second.version_id
    assert s3.get_object("versioned", "x", version_id=first.version_id)["Body"].read() == b"one"
    assert s3.get_object("versioned", "x", byte_range="bytes=1-1")["Body"].read() == b"w"


def _get(connection: http.client.HTTPConnection, path: str, headers: dict[str, str] | None = None) -> tuple:
    connection.request("GET", path, headers=headers or {})
    response = connection.getresponse()
    return response.status, response.getheader("Retry-After"), response.read()


def test_proxy_keeps_connections_alive_and_counts(nginx: Nginx, fault_proxy: Callable[[str], FaultProxy]) -> None:
    nginx.put("x.bin", BODY)
    proxy = fault_proxy(nginx.url)
    connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    for start in (0, 5000, 60000):
        assert _get(connection, "/x.bin", {"Range": f"bytes={start}-{start + 99}"})[2] == BODY[start : start + 100]
    connection.close()
    stats = proxy.stats()
    assert (stats.requests, stats.forwarded, stats.body_bytes) == (3, 3, 300)
    entries = nginx.log.entries(at_least=3)
    assert len({entry.connection for entry in entries}) == 1  # one upstream connection for the three


def test_proxy_resets_mid_body(nginx: Nginx, fault_proxy: Callable[[str], FaultProxy]) -> None:
    url = nginx.put("x.bin", BODY)
    proxy = fault_proxy(nginx.url)
    proxy.reset_next(1, after_bytes=1000)
    connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    connection.request("GET", "/x.bin")
    response = connection.getresponse()
    assert response.status == 200
    with pytest.raises((http.client.IncompleteRead, ConnectionResetError)):
        response.read()
    connection.close()
    assert http_get(url.replace(nginx.url, proxy.url))[2] == BODY  # the next one goes through whole
    assert proxy.stats().resets == 1
    assert [r.body_bytes for r in proxy.requests()] == [1000, len(BODY)]


@pytest.mark.parametrize("status", [503, 429])
def test_proxy_fails_the_first_requests(status: int, nginx: Nginx, fault_proxy: Callable[[str], FaultProxy]) -> None:
    nginx.put("x.bin", BODY)
    proxy = fault_proxy(nginx.url)
    proxy.fail_next(2, status=status, retry_after=1)
    connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    answers = [_get(connection, "/x.bin", {"Range": "bytes=0-9"}) for _ in range(3)]
    connection.close()
    assert [(s, r) for s, r, _ in answers] == [(status, "1"), (status, "1"), (206, None)]
    assert answers[2][2] == BODY[:10]
    stats = proxy.stats()
    assert (stats.requests, stats.failed, stats.forwarded) == (3, 2, 1)
    assert len(nginx.log.entries(at_least=1)) == 1  # the failures never reached nginx


def test_proxy_latency_is_counted(nginx: Nginx, fault_proxy: Callable[[str], FaultProxy]) -> None:
    nginx.put("x.bin", BODY)
    proxy = fault_proxy(nginx.url)
    proxy.set_latency(0.02)
    for _ in range(3):
        assert http_get(f"{proxy.url}/x.bin", {"Range": "bytes=0-0"})[0] == 206
    assert proxy.stats().delayed >= 3


def test_proxy_ignoring_range_gives_the_whole_body(nginx: Nginx, fault_proxy: Callable[[str], FaultProxy]) -> None:
    nginx.put("x.bin", BODY)
    proxy = fault_proxy(nginx.url)
    proxy.set_ignore_range()
    status, headers, body = http_get(f"{proxy.url}/x.bin", {"Range": "bytes=0-9"})
    assert (status, body) == (200, BODY) and "content-range" not in headers
    [entry] = nginx.log.entries(at_least=1)
    assert (entry.range, entry.body_bytes) == ("", len(BODY))
    assert proxy.requests()[0].range == "bytes=0-9" and proxy.stats().ranges_stripped == 1


def test_proxy_hook_replaces_the_object_between_requests(
    nginx: Nginx, fault_proxy: Callable[[str], FaultProxy]
) -> None:
    nginx.put("x.bin", BODY)
    proxy = fault_proxy(nginx.url)
    proxy.on_request(lambda number, method, target: number == 2 and nginx.replace("x.bin", b"new"))
    _, first, _ = http_get(f"{proxy.url}/x.bin", {"Range": "bytes=0-9"})
    # The second request reaches nginx after the hook replaced the file: the pinned ETag no longer matches.
    assert http_get(f"{proxy.url}/x.bin", {"Range": "bytes=0-9", "If-Match": first["etag"]})[0] == 412
    assert http_get(f"{proxy.url}/x.bin")[2] == b"new"


def test_proxy_stall_outlasts_a_client_timeout(nginx: Nginx, fault_proxy: Callable[[str], FaultProxy]) -> None:
    nginx.put("x.bin", BODY)
    proxy = fault_proxy(nginx.url)
    proxy.stall_next(1, after_bytes=10, seconds=30)
    connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=0.3)
    connection.request("GET", "/x.bin")
    response = connection.getresponse()
    with pytest.raises((TimeoutError, socket.timeout)):
        response.read()
    connection.close()
    assert proxy.stats().stalls == 1  # teardown stops the proxy without waiting out the stall


def test_proxy_in_front_of_moto_and_the_hub_cdn(
    s3: S3, hub: FakeHub, hf_repo: tuple[str, dict], fault_proxy: Callable[[str], FaultProxy]
) -> None:
    s3.create_bucket("bucket")
    s3.put_object("bucket", "x", BODY)
    proxy = fault_proxy(s3.endpoint)
    via_proxy = S3(proxy.url)
    assert via_proxy.get_object("bucket", "x", byte_range="bytes=7-9")["Body"].read() == BODY[7:10]
    assert proxy.stats().body_bytes == 3
    big = BODY * 40  # boto3 sends Expect: 100-continue with a body this size
    via_proxy.put_object("bucket", "big", big)
    assert s3.get_object("bucket", "big")["Body"].read() == big

    cdn_proxy = fault_proxy(hub.nginx.cdn_url)
    hub.nginx.set_redirect_base(cdn_proxy.url)
    request = urllib.request.Request(
        hub.resolve_url("org", "repo", "model.safetensors"), headers={"Range": "bytes=0-4"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.read() == BODY[:5]
    assert cdn_proxy.stats().forwarded == 1
