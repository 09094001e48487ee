"""The contract every byte source keeps, run against each implementation (as fsspec's tests/abstract do).

A new source joins by adding a ``Setup`` to ``SETUPS``: a way to publish a tree of files (with the test
servers of tests/servers.py where it needs one) and open the source that serves them. Every test here then
runs against it: local files, S3 (moto), the Hub (nginx) and the Hub over HTTPS (its API and its CDN behind the
tests' proxy serving TLS: bodies read by stfs._tls). Plain HTTP cannot list a folder, so it has no setup here;
tests/test_remote*.py cover it.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stfs.sources import ByteSource, Kind, LocalFiles, SpliceSource, join_key, open_source, parent_key, relative_key
from stfs.sources.mapped import MappedFiles
from tests.registry import Artifact, make_tar, oras, push, sha256_digest, write_oci_layout

Files = dict[str, bytes]


@dataclass
class Setup:
    """Publishes ``files`` (relative path -> bytes) and opens a source on them; returns the source and
    the key of the folder that holds them. ``request`` gives the servers' fixtures."""

    name: str
    open: Callable[[pytest.FixtureRequest, Path, Files], tuple[ByteSource, str]]


def _local(request: pytest.FixtureRequest, folder: Path, files: Files) -> tuple[ByteSource, str]:
    for relative, data in files.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return LocalFiles(), str(folder)


def _s3(request: pytest.FixtureRequest, folder: Path, files: Files) -> tuple[ByteSource, str]:
    s3 = request.getfixturevalue("s3")
    bucket = s3.create_bucket("contract")
    for relative, data in files.items():
        s3.put_object(bucket, f"root/{relative}", data)
    return open_source(f"s3://{bucket}/root/")


def _hub(request: pytest.FixtureRequest, folder: Path, files: Files) -> tuple[ByteSource, str]:
    hub = request.getfixturevalue("hub")
    hub.publish_repo("org", "contract", files)
    return open_source("hf://org/contract")


def _hub_over_tls(request: pytest.FixtureRequest, folder: Path, files: Files) -> tuple[ByteSource, str]:
    hub, tls_files = request.getfixturevalue("hub"), request.getfixturevalue("tls_files")
    if tls_files is None:
        pytest.skip("no TLS here (cryptography)")
    make_proxy = request.getfixturevalue("fault_proxy")
    api, cdn = make_proxy(hub.nginx.hub_url, tls_files), make_proxy(hub.nginx.cdn_url, tls_files)
    hub.nginx.set_redirect_base(cdn.url)
    request.getfixturevalue("monkeypatch").setenv("HF_ENDPOINT", api.url)
    hub.publish_repo("org", "contract", files)
    return open_source("hf://org/contract")


def _oci(request: pytest.FixtureRequest, folder: Path, files: Files) -> tuple[ByteSource, str]:
    """ORAS's layout: a layer per file, named by its title (the blobs read by Range from a real registry)."""
    registry = request.getfixturevalue("registry")
    repo = registry.repo("contract")
    push(registry, repo, "v1", oras(files))
    return open_source(f"oci://{registry.host}/{repo}:v1")


def _oci_tar(request: pytest.FixtureRequest, folder: Path, files: Files) -> tuple[ByteSource, str]:
    """ModelPack's tar layers: each file a member of a tar, a range of its blob."""
    registry = request.getfixturevalue("registry")
    repo = registry.repo("contract-tar")
    push(registry, repo, "v1", modelpack_any(files))
    return open_source(f"oci://{registry.host}/{repo}:v1")


def modelpack_any(files: Files) -> Artifact:
    """ModelPack's tar layers for files of any name (modctl's own kinds know model files' names only)."""
    base = oras({})
    layers, blobs = [], dict(base.blobs)
    for name, data in files.items():
        blob = make_tar({name: data})
        digest = sha256_digest(blob)
        blobs[digest] = blob
        media_type = "application/vnd.cncf.model.weight.v1.tar"
        layers.append({"mediaType": media_type, "digest": digest, "size": len(blob), "annotations": {}})
    return Artifact({**base.manifest, "layers": layers}, base.media_type, blobs)


def _oci_layout(request: pytest.FixtureRequest, folder: Path, files: Files) -> tuple[ByteSource, str]:
    """An OCI image layout on disk, its blobs read in place."""
    write_oci_layout(folder, {"v1": oras(files)})
    return open_source(str(folder))


def _oci_image(request: pytest.FixtureRequest, folder: Path, files: Files) -> tuple[ByteSource, str]:
    """A container image of two gzip layers (a file the upper one removes; no /models: the model from its root), read
    at random through each layer's one pass."""
    from tests.images import image, layer_tar

    registry = request.getfixturevalue("registry")
    repo = registry.repo("contract-image")
    names = sorted(files)
    lower = layer_tar([(name, files[name]) for name in names[:2]] + [("gone", b"x")])
    upper = layer_tar([(".wh.gone", b"")] + [(name, files[name]) for name in names[2:]])
    push(registry, repo, "v1", image([lower, upper]))
    return open_source(f"oci://{registry.host}/{repo}:v1")


SETUPS = [
    Setup("local", _local),
    Setup("s3", _s3),
    Setup("hub", _hub),
    Setup("hub-https", _hub_over_tls),
    Setup("oci", _oci),
    Setup("oci-tar", _oci_tar),
    Setup("oci-layout", _oci_layout),
    Setup("oci-image", _oci_image),
]

FILES: Files = {
    "a.safetensors": random.Random(1).randbytes(1_000_000),  # blocks of it longer than an HTTPS read's slice
    "sub/b.bin": b"0123456789" * 1000,
    "sub/deeper/c.json": b'{"x": 1}',
    "empty": b"",
}


@pytest.fixture(params=SETUPS, ids=lambda setup: setup.name)
def published(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[ByteSource, str]]:
    source, root = request.param.open(request, tmp_path / "root", FILES)
    yield source, root
    source.close()


def test_kind(published: tuple[ByteSource, str]) -> None:
    source, root = published
    assert source.kind(root) is Kind.FOLDER
    assert source.kind(join_key(root, "sub")) is Kind.FOLDER
    assert source.kind(join_key(root, "a.safetensors")) is Kind.FILE
    assert source.kind(join_key(root, "empty")) is Kind.FILE
    assert source.kind(join_key(root, "missing")) is None


def test_walk_lists_every_file_below_sorted(published: tuple[ByteSource, str]) -> None:
    source, root = published
    keys = source.walk(root)
    assert keys == sorted(keys)
    assert [relative_key(root, key) for key in keys] == sorted(FILES)
    assert [relative_key(root, key) for key in source.walk(join_key(root, "sub"))] == ["sub/b.bin", "sub/deeper/c.json"]


def test_stat_gives_size_and_a_version(published: tuple[ByteSource, str]) -> None:
    source, root = published
    for relative, data in FILES.items():
        info = source.stat(join_key(root, relative))
        assert info.size == len(data) and info.key == join_key(root, relative)
        assert info.version and info.version == source.stat(join_key(root, relative)).version
    with pytest.raises(OSError):
        source.stat(join_key(root, "missing"))


def test_read_returns_exact_bytes_short_only_at_the_end(published: tuple[ByteSource, str]) -> None:
    source, root = published
    key = join_key(root, "a.safetensors")
    data = FILES["a.safetensors"]
    rng = random.Random(2)
    for _ in range(100):
        offset, size = rng.randrange(0, len(data) + 10), rng.choice([0, 1, 8, 4096, 100_000, 400_000])
        assert source.read(key, offset, size) == data[offset : offset + size]
    assert source.read(join_key(root, "empty"), 0, 8) == b""


def test_read_into_fills_the_buffer(published: tuple[ByteSource, str]) -> None:
    source, root = published
    key = join_key(root, "a.safetensors")
    data = FILES["a.safetensors"]
    for offset, size in [(0, 8), (1001, 4096), (len(data) - 5000, 5000), (7, 299_993), (1001, 600_000)]:
        buffer = bytearray(size)
        assert source.read_into(key, offset, memoryview(buffer)) == size
        assert bytes(buffer) == data[offset : offset + size]


def test_a_missing_file_is_an_oserror(published: tuple[ByteSource, str]) -> None:
    source, root = published
    with pytest.raises(OSError):
        source.read(join_key(root, "missing"), 0, 4)
    with pytest.raises(OSError):
        source.read_into(join_key(root, "missing"), 0, memoryview(bytearray(4)))


def test_a_listed_sha256_is_the_files(published: tuple[ByteSource, str]) -> None:
    """Where the store's listing gives a file's sha256 (the Hub's LFS files), it is the sha256 of its bytes; local files
    and S3 objects have none without reading them."""
    source, root = published
    listed = {relative: source.listed_sha256(join_key(root, relative)) for relative in FILES}
    for relative, sha256 in listed.items():
        assert sha256 is None or sha256 == hashlib.sha256(FILES[relative]).hexdigest(), relative
    hub = type(source).__name__ == "RemoteFiles" and root.startswith("hf://")
    # an OCI artifact's file that is a whole blob: the blob's digest is its sha256 (a tar member's is not)
    whole_blob = isinstance(source, MappedFiles) and source.files[join_key(root, "a.safetensors")].whole
    assert (listed["a.safetensors"] is not None) == (hub or whole_blob)  # .safetensors files go to the Hub's LFS


def test_splice_moves_the_same_bytes(published: tuple[ByteSource, str]) -> None:
    source, root = published
    if not isinstance(source, SpliceSource):
        pytest.skip("this source cannot splice")
    key = join_key(root, "a.safetensors")
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        assert source.splice_into(key, 1001, 50_000, write_end) == 50_000
        received = b""
        while len(received) < 50_000:
            received += os.read(read_end, 65536)
        assert received == FILES["a.safetensors"][1001:51_001]
    finally:
        os.close(read_end)
        os.close(write_end)


def test_key_arithmetic() -> None:
    assert join_key(["/m", "index.json"][0], "./s/a.safetensors") == "/m/s/a.safetensors"
    assert parent_key("/m/x.safetensors") == "/m"
    assert relative_key("/m", "/m/sub/x") == "sub/x"
    assert join_key("https://host:8/a/b", "../c//d") == "https://host:8/a/c/d"
    assert parent_key("s3://bucket/dir/x.json") == "s3://bucket/dir"
    assert relative_key("s3://bucket/dir", "s3://bucket/dir/sub/x") == "sub/x"
    assert join_key("s3://bucket", "x") == "s3://bucket/x"
