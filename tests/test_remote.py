"""Remote sources mounted for real (SPEC §7): the same tree as a local mount of the same files, for http(s)://,
s3:// and hf://; ``files/``; the URL in ``user.safetensors.file``; bytes equal and fetched sparingly."""

from __future__ import annotations

import os
import random
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import MountFn, read_cold, tensor_path
from tests.remote_helpers import (
    MIB,
    big_model,
    one_file,
    publish_hub,
    publish_nginx,
    publish_s3,
    repository,
    several_models,
    sharded,
    source_xattrs,
    walk,
)
from tests.servers import S3, FakeHub, FaultProxy, Nginx

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True, slots=True)
class Case:
    """A local SOURCE and the URL of the same files on a server; ``root`` and ``base`` map one's keys to the other's."""

    local: str
    url: str
    root: Path  # the local folder the URL's ``base`` mirrors
    base: str


def _http(request: pytest.FixtureRequest, tmp: Path, what: str) -> Case:
    nginx: Nginx = request.getfixturevalue("nginx")
    folder = tmp / "m"
    local = one_file(folder) if what == "file" else sharded(folder)
    base = publish_nginx(nginx, folder, "models/m")
    if what == "https":
        if nginx.https_url is None:
            pytest.skip("no TLS here")
        base = base.replace(nginx.url, nginx.https_url)
    return Case(str(local), f"{base}/{local.name}", folder, base)


def _s3(request: pytest.FixtureRequest, tmp: Path, what: str) -> Case:
    s3: S3 = request.getfixturevalue("s3")
    folder = tmp / "m"
    if what == "prefix":
        several_models(folder)
        repository(folder / "llm")
        base = publish_s3(s3, folder, "bucket", "org/models")
        return Case(str(folder), base + "/", folder, base)
    local = one_file(folder) if what == "file" else sharded(folder)
    base = publish_s3(s3, folder, "bucket", "a/b")
    return Case(str(local), f"{base}/{local.name}", folder, base)


def _hf(request: pytest.FixtureRequest, tmp: Path, what: str) -> Case:
    hub: FakeHub = request.getfixturevalue("hub")
    folder = tmp / "repo"
    if what == "root":
        repository(folder)
        commit = publish_hub(hub, folder)
        return Case(str(folder), "hf://org/repo", folder, f"hf://org/repo@{commit}")
    if what == "revision":
        one_file(folder)
        commit = publish_hub(hub, folder)
        newer = tmp / "newer"
        sharded(newer)
        publish_hub(hub, newer)  # main moves on; the mount names the old commit
        return Case(str(folder), f"hf://org/repo@{commit}", folder, f"hf://org/repo@{commit}")
    several_models(folder)
    commit = publish_hub(hub, folder)
    if what == "folder":
        return Case(str(folder / "text_encoder"), "hf://org/repo/text_encoder", folder, f"hf://org/repo@{commit}")
    local = folder / "vae" / "rich.safetensors"
    return Case(str(local), "hf://org/repo@main/vae/rich.safetensors", folder, f"hf://org/repo@{commit}")


CASES: dict[str, Callable[[pytest.FixtureRequest, Path], Case]] = {
    "http-file": lambda r, t: _http(r, t, "file"),
    "http-index": lambda r, t: _http(r, t, "index"),
    "https-file": lambda r, t: _http(r, t, "https"),
    "s3-file": lambda r, t: _s3(r, t, "file"),
    "s3-index": lambda r, t: _s3(r, t, "index"),
    "s3-prefix": lambda r, t: _s3(r, t, "prefix"),
    "hf-root": lambda r, t: _hf(r, t, "root"),
    "hf-revision": lambda r, t: _hf(r, t, "revision"),
    "hf-folder": lambda r, t: _hf(r, t, "folder"),
    "hf-file": lambda r, t: _hf(r, t, "file"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_tree_as_a_local_mount(
    case: str, request: pytest.FixtureRequest, mount: MountFn, tmp_path: Path
) -> None:
    published = CASES[case](request, tmp_path)
    local_mnt = mount(published.local)
    remote_mnt = mount(published.url)
    local, remote = walk(local_mnt), walk(remote_mnt)
    assert sorted(remote) == sorted(local)
    for path, entry in local.items():
        assert remote[path] == entry, path
    # files/ mirrors the source: config.json and the like included where SOURCE is a folder or a repository
    assert any(path.startswith("files/") for path in remote)
    # user.safetensors.file: the URL of the same file (no credentials; the Hub's commit pinned)
    local_files, remote_files = source_xattrs(local_mnt), source_xattrs(remote_mnt)
    assert sorted(remote_files) == sorted(local_files)
    for path, local_key in local_files.items():
        relative = os.path.relpath(local_key, published.root)
        assert remote_files[path] == f"{published.base}/{relative}", path


@pytest.mark.parametrize("spelling", ["bucket/repo", "bucket/repo/", "bucket"])
def test_files_of_a_bucket_prefix_include_every_regular_file(
    spelling: str, s3: S3, mount: MountFn, tmp_path: Path
) -> None:
    folder = repository(tmp_path / "repo")
    publish_s3(s3, folder, "bucket", "repo")
    mnt = mount(f"s3://{spelling}")
    files = os.path.join(mnt, "files", "repo") if spelling == "bucket" else os.path.join(mnt, "files")
    listed = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    mirrored = sorted(os.path.relpath(os.path.join(d, f), files) for d, _, fs in os.walk(files) for f in fs)
    assert mirrored == listed
    with open(os.path.join(files, "config.json")) as stream:
        assert '"hidden_size": 8' in stream.read()
    assert os.path.isdir(os.path.join(mnt, "tensors"))  # the one model of the prefix at the root


def test_safe_open_through_files_of_a_hub_repository(hub: FakeHub, mount: MountFn, tmp_path: Path) -> None:
    import numpy as np
    from safetensors import safe_open

    from tests.models import sharded_arrays

    folder = repository(tmp_path / "repo")
    publish_hub(hub, folder)
    mnt = mount("hf://org/repo")
    for shard, arrays in sharded_arrays().items():  # what from_pretrained(MNT/files) does
        with safe_open(os.path.join(mnt, "files", shard), "numpy") as handle:
            assert sorted(handle.keys()) == sorted(arrays)
            for name, array in arrays.items():
                assert np.array_equal(handle.get_tensor(name), array)


def test_a_hub_file_is_resolved_once_then_read_from_the_cdn(hub: FakeHub, mount: MountFn, tmp_path: Path) -> None:
    """The Hub's ``resolve/`` URL of a file is asked for once (a HEAD with the token), not once a block: every read
    of the file's bytes after that goes to where it pointed (the CDN), without the token."""
    local = big_model(tmp_path / "big.safetensors", TENSORS, TENSOR_BYTES)
    hub.publish_repo("org", "repo", {"big.safetensors": local.read_bytes()})
    mnt = mount("hf://org/repo")
    hub.log.clear()
    hub.cdn_log.clear()
    assert read_cold(os.path.join(mnt, "files", "big.safetensors")) == local.read_bytes()
    resolves = [entry for entry in hub.log.entries(at_least=1) if "/resolve/" in entry.uri]
    assert [entry.method for entry in resolves] == ["HEAD"]
    reads = hub.cdn_log.entries(at_least=2)
    assert len(reads) >= 2 and all(entry.method == "GET" and entry.range for entry in reads)
    assert all(entry.authorization == "" for entry in reads)


@pytest.mark.parametrize(
    ("versioned", "unsigned"),
    [(False, False), (True, False), (False, True)],
    ids=["unversioned", "versioned", "public"],
)
def test_an_s3_object_is_read_through_urls_obstore_presigns(
    versioned: bool,
    unsigned: bool,
    s3: S3,
    fault_proxy: Callable[[str], FaultProxy],
    mount: MountFn,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An S3 object's blocks are read by stfs's own client from URLs obstore presigned (no ``Authorization``
    header; the signature in the query, If-Match its ETag). An object pinned by its VersionId is read through
    obstore still: a version in the query would have to be signed with it; so is a public bucket read without
    credentials (``AWS_SKIP_SIGNATURE``): nothing could sign."""
    local = big_model(tmp_path / "big.safetensors", TENSORS, TENSOR_BYTES)
    s3.create_bucket("bucket", versioned=versioned)
    s3.put_object("bucket", "big.safetensors", local.read_bytes())
    proxy = fault_proxy(s3.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    if unsigned:
        s3.client.put_object_acl(Bucket="bucket", Key="big.safetensors", ACL="public-read")
        monkeypatch.setenv("AWS_SKIP_SIGNATURE", "true")
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    mnt = mount("s3://bucket/big.safetensors")
    before = len(proxy.requests())
    assert read_cold(os.path.join(mnt, "files", "big.safetensors")) == local.read_bytes()
    reads = [request for request in proxy.requests()[before:] if request.method == "GET" and request.range]
    assert len(reads) >= 2 and all(request.status == 206 for request in reads)
    presigned = ["X-Amz-Signature=" in request.target for request in reads]
    assert presigned == [not versioned and not unsigned] * len(reads), [r.target.split("?")[0] for r in reads]


# --- bytes ----------------------------------------------------------------------------------------------

TENSORS = 6
TENSOR_BYTES = 3 * MIB + 12345  # not a multiple of any block size: clipping shows


@pytest.fixture
def served_big(nginx: Nginx, tmp_path: Path) -> tuple[Path, str]:
    local = big_model(tmp_path / "big.safetensors", TENSORS, TENSOR_BYTES)
    return local, nginx.put("big.safetensors", local.read_bytes())


def _body_bytes(nginx: Nginx) -> int:
    return sum(entry.body_bytes for entry in nginx.log.entries())


def test_whole_tensor_reads_fetch_only_what_they_read(
    nginx: Nginx, served_big: tuple[Path, str], mount: MountFn
) -> None:
    local, url = served_big
    mnt = mount(url)
    nginx.log.clear()
    read = 0
    for i in (0, 3, 5):
        data = read_cold(tensor_path(mnt, f"layers.{i}.weight"))
        assert data == _tensor(local, i)
        read += len(data)
    entries = nginx.log.entries()
    assert entries and all(entry.status == 206 and entry.if_match for entry in entries)
    assert _body_bytes(nginx) / read <= 1.1


def test_a_whole_model_read_fetches_it_about_once(nginx: Nginx, served_big: tuple[Path, str], mount: MountFn) -> None:
    local, url = served_big
    nginx.log.clear()
    mnt = mount(url)
    read = 0
    for i in range(TENSORS):
        data = read_cold(tensor_path(mnt, f"layers.{i}.weight"))
        assert data == _tensor(local, i)
        read += len(data)
    assert _body_bytes(nginx) / read <= 1.1  # the header's speculative read included
    nginx.log.clear()
    with open(os.path.join(mnt, "files", "big.safetensors"), "rb") as stream:
        assert stream.read() == local.read_bytes()
    assert _body_bytes(nginx) <= len(local.read_bytes()) - read  # files/ shares the block cache: no tensor again


def test_a_whole_file_read_through_files_fetches_it_about_once(
    nginx: Nginx, served_big: tuple[Path, str], mount: MountFn
) -> None:
    local, url = served_big
    nginx.log.clear()
    mnt = mount(url)
    assert read_cold(os.path.join(mnt, "files", "big.safetensors")) == local.read_bytes()
    assert _body_bytes(nginx) / local.stat().st_size <= 1.1


def test_random_reads_return_the_source_bytes(served_big: tuple[Path, str], mount: MountFn) -> None:
    local, url = served_big
    mnt = mount(url)
    rng = random.Random(7)
    whole = local.read_bytes()
    tensors = [_tensor(local, i) for i in range(TENSORS)]
    for _ in range(60):
        i = rng.randrange(TENSORS)
        offset = rng.randrange(TENSOR_BYTES + 10)
        size = rng.choice([1, 100, 4096, 65536, 300_000, 2 * MIB])
        assert read_cold(tensor_path(mnt, f"layers.{i}.weight"), offset, size) == tensors[i][offset : offset + size]
    source = os.path.join(mnt, "files", "big.safetensors")
    for _ in range(30):
        offset, size = rng.randrange(len(whole)), rng.choice([1, 8, 5000, MIB])
        assert read_cold(source, offset, size) == whole[offset : offset + size]


def _tensor(local: Path, index: int) -> bytes:
    from tests.models import tensor_bytes

    return tensor_bytes(str(local), f"layers.{index}.weight")


def test_concurrent_readers_with_a_tiny_cache(served_big: tuple[Path, str], mount: MountFn) -> None:
    """Eight readers at once, sequential and random, through a cache far smaller than the model: blocks are
    evicted while others wait on fetches of the same blocks."""
    from concurrent.futures import ThreadPoolExecutor

    local, url = served_big
    mnt = mount(url, options=["cache_size=2M"])
    tensors = [_tensor(local, i) for i in range(TENSORS)]

    def reader(seed: int) -> int:
        rng = random.Random(seed)
        checked = 0
        for _ in range(12):
            i = rng.randrange(TENSORS)
            path = tensor_path(mnt, f"layers.{i}.weight")
            if rng.random() < 0.3:
                assert read_cold(path) == tensors[i]
            else:
                offset, size = rng.randrange(TENSOR_BYTES), rng.choice([4096, 200_000, MIB])
                assert read_cold(path, offset, size) == tensors[i][offset : offset + size]
            checked += 1
        return checked

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(reader, range(8))) == 96


@pytest.mark.parametrize("spelled", ["encoded", "raw"])
def test_a_url_names_its_file_percent_encoded_or_not(
    spelled: str, nginx: Nginx, mount: MountFn, tmp_path: Path
) -> None:
    """``my%20model%20%C3%A9.safetensors``, as a browser copies a URL, is the file ``my model é.safetensors``: obstore,
    which encodes the name it is given, asked for ``my%2520model…`` (404) before."""
    import numpy as np

    from tests.models import write_numpy

    local = tmp_path / "m.safetensors"
    write_numpy(str(local), {"a": np.arange(1 << 18, dtype=np.float32), "b": np.ones(1 << 18, dtype=np.float32)})
    name = "my model é.safetensors"
    nginx.put(name, local.read_bytes())
    url = f"{nginx.url}/{urllib.parse.quote(name) if spelled == 'encoded' else name}"
    mnt = mount(url)
    (served,) = os.listdir(os.path.join(mnt, "files"))
    assert Path(mnt, "files", served).read_bytes() == local.read_bytes()  # the first read by obstore, the rest not
    assert read_cold(tensor_path(mnt, "b")) == np.ones(1 << 18, dtype=np.float32).tobytes()
