"""A mount costs what it needs (SPEC §7): mounting a Hub repository or an S3 prefix makes the listing's requests
and one request per safetensors file or index (its header); config.json, tokenizer files and the rest are pinned
from the listing (size, ETag) and cost nothing until they are read. Counted on the servers' side: nginx's access
logs for the Hub, the fault proxy in front of moto for S3."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests.helpers import MountFn, changed, read_cold
from tests.remote_helpers import files_of, publish_hub, publish_s3, repository
from tests.servers import S3, FakeHub, FaultProxy

pytestmark = pytest.mark.timeout(120)

HEADERS = {"model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
OTHERS = {"config.json", "tokenizer/vocab.txt", "empty.txt"}


def test_a_hub_repository(hub: FakeHub, mount: MountFn, tmp_path: Path) -> None:
    folder = repository(tmp_path / "repo")
    assert set(files_of(folder)) == HEADERS | OTHERS
    commit = publish_hub(hub, folder)
    hub.log.clear()
    hub.cdn_log.clear()
    mnt = mount("hf://org/repo")
    api = [entry.uri for entry in hub.log.entries(at_least=4) if entry.uri.startswith("/api/")]
    assert api == ["/api/models/org/repo/revision/main?blobs=true"]  # the file list comes with the commit
    resolved = [unquote(entry.uri) for entry in hub.log.entries() if "/resolve/" in entry.uri]
    assert sorted(resolved) == sorted(f"/org/repo/resolve/{commit}/{name}" for name in HEADERS)
    assert sorted(urlsplit(entry.uri).path for entry in hub.cdn_log.entries(at_least=3)) == sorted(
        f"/org/repo/{commit}/{name}" for name in HEADERS
    )
    assert sorted(os.listdir(os.path.join(mnt, "files"))) == sorted(["config.json", "empty.txt", "tokenizer", *HEADERS])
    assert os.path.getsize(os.path.join(mnt, "files", "tokenizer", "vocab.txt")) == 2560

    # a file pinned from the list: its first read is its one request, of its bytes only
    hub.cdn_log.clear()
    assert read_cold(os.path.join(mnt, "files", "config.json")) == (folder / "config.json").read_bytes()
    [entry] = hub.cdn_log.entries(at_least=1)
    assert urlsplit(entry.uri).path == f"/org/repo/{commit}/config.json"
    assert entry.body_bytes == (folder / "config.json").stat().st_size
    assert read_cold(os.path.join(mnt, "files", "empty.txt")) == b""
    assert (
        read_cold(os.path.join(mnt, "files", "tokenizer", "vocab.txt")) == (folder / "tokenizer/vocab.txt").read_bytes()
    )
    assert changed(mnt) == []


def test_an_s3_prefix(
    s3: S3, fault_proxy: Callable[[str], FaultProxy], mount: MountFn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = repository(tmp_path / "repo")
    base = publish_s3(s3, folder, "bucket", "org/llm")
    proxy = fault_proxy(s3.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)  # the daemon's requests go through the proxy, which counts
    mnt = mount(base + "/")
    requests = proxy.requests()
    listings = [r for r in requests if "list-type=2" in r.target]
    gets = sorted(unquote(urlsplit(r.target).path) for r in requests if r not in listings)
    assert listings and all(r.method == "GET" for r in requests)
    assert gets == sorted(f"/bucket/org/llm/{name}" for name in HEADERS)
    assert len(listings) == 1  # one page: discovery and files/ share the listing

    before = len(proxy.requests())
    path = os.path.join(mnt, "files", "tokenizer", "vocab.txt")
    assert os.path.getsize(path) == 2560
    assert read_cold(path) == (folder / "tokenizer" / "vocab.txt").read_bytes()
    [read] = proxy.requests()[before:]
    assert unquote(urlsplit(read.target).path) == "/bucket/org/llm/tokenizer/vocab.txt" and read.body_bytes == 2560
    assert changed(mnt) == []  # the listing's ETags are the objects' ETags
    # pinned from the listing's ETag: a file put over after the mount gives EIO, never the new bytes
    s3.put_object("bucket", "org/llm/config.json", b'{"changed": true}')
    with pytest.raises(OSError) as raised:
        read_cold(os.path.join(mnt, "files", "config.json"))
    assert raised.value.errno == errno.EIO
    assert changed(mnt) == [f"{base}/config.json"]
