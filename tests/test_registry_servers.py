"""The OCI registry test servers themselves (tests/registry.py), driven with plain ``http.client``: what the
``oci://`` tests rely on is checked here against the real distribution 2.8.2."""

from __future__ import annotations

import base64
import gzip
import hashlib
import http.client
import io
import json
import os
import socket
import tarfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import pytest

from tests.conftest import TokenRegistry
from tests.registry import (
    DMR_GGUF,
    DMR_LICENSE,
    DOCKER_MANIFEST,
    FILE_METADATA,
    FILEPATH,
    MANIFEST_ACCEPT,
    MODEL_ARTIFACT,
    MODEL_CONFIG,
    OCI_INDEX,
    OCI_MANIFEST,
    OLLAMA_CONFIG,
    OLLAMA_MODEL,
    REF_NAME,
    TITLE,
    UNPACK,
    Artifact,
    BlobRedirector,
    Registry,
    RegistryClient,
    decode_jwt,
    docker_model_runner,
    folder_tar,
    go_json,
    index,
    long_name_tar,
    modelpack,
    ollama,
    oras,
    push,
    push_index,
    tar_members,
    write_oci_layout,
    write_ollama_models,
)

WEIGHTS = bytes(range(256)) * 64  # 16 KiB, every byte value at a known offset
GGUF = b"GGUF" + (3).to_bytes(4, "little") + bytes(range(200))


def request(
    url: str, method: str = "GET", headers: dict[str, str] | None = None, body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=10)
    try:
        connection.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), body, headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def challenge(header: str) -> dict[str, str]:
    scheme, _, rest = header.partition(" ")
    assert scheme == "Bearer"
    return dict(part.split("=", 1) for part in rest.replace('"', "").split(","))


def token_for(
    token_registry: TokenRegistry, scope: str, credentials: tuple[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    query = urlencode({"service": Registry.SERVICE, "scope": scope})
    headers = {}
    if credentials is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(":".join(credentials).encode()).decode()
    status, _, body = request(f"{token_registry.issuer.realm}?{query}", headers=headers)
    return status, json.loads(body)


ARTIFACTS: dict[str, Any] = {
    "modelpack-raw": lambda: modelpack(
        {"config.json": b'{"model_type": "llama"}', "model.safetensors": WEIGHTS, "README.md": b"# test\n"}
    ),
    "modelpack-tar": lambda: modelpack({"model.safetensors": WEIGHTS, "tokenizer.json": b"{}"}, tar=True),
    "modelpack-tar-gzip": lambda: modelpack({"model.safetensors": WEIGHTS}, compressed=True),
    "oras": lambda: oras({"model.gguf": GGUF}, {"shards": {"index.json": b"{}", "part-1.bin": WEIGHTS}}),
    "oras-plain-folder": lambda: oras({}, {"shards": {"part-1.bin": WEIGHTS}}, folder_gzip=False),
    "ollama": lambda: ollama(GGUF, params={"stop": ["<|eot_id|>"]}, system="Be brief.", license="MIT"),
    "docker-model-runner": lambda: docker_model_runner(gguf=GGUF, license="Apache-2.0"),
    "docker-model-runner-safetensors": lambda: docker_model_runner(safetensors=WEIGHTS, annotated=False),
}


@pytest.mark.parametrize("kind", sorted(ARTIFACTS))
def test_push_and_read_back(registry: Registry, kind: str) -> None:
    artifact: Artifact = ARTIFACTS[kind]()
    repo = registry.repo(kind)
    digest = push(registry, repo, "v1", artifact)
    assert digest == artifact.digest == "sha256:" + hashlib.sha256(artifact.manifest_bytes()).hexdigest()
    for ref in ("v1", digest):
        status, headers, body = request(
            f"{registry.url}/v2/{repo}/manifests/{ref}", headers={"Accept": MANIFEST_ACCEPT}
        )
        assert status == 200
        assert headers["docker-content-digest"] == digest
        assert headers["content-type"] == artifact.media_type
        assert body == artifact.manifest_bytes()
    manifest = json.loads(body)
    for descriptor in [manifest["config"], *manifest["layers"]]:
        status, headers, data = request(f"{registry.url}/v2/{repo}/blobs/{descriptor['digest']}")
        assert status == 200
        assert len(data) == descriptor["size"]
        assert "sha256:" + hashlib.sha256(data).hexdigest() == descriptor["digest"]
        assert data == artifact.blobs[descriptor["digest"]]


def test_push_skips_blobs_the_registry_has(registry: Registry) -> None:
    artifact = oras({"model.gguf": GGUF})
    repo = registry.repo("skip")
    client = RegistryClient(registry.url)
    layer = artifact.layers[0]["digest"]
    assert client.push_blob(repo, layer, GGUF) is True
    assert client.push_blob(repo, layer, GGUF) is False
    assert push(registry, repo, "v1", artifact) == artifact.digest


def test_index_push_and_children(registry: Registry) -> None:
    model = modelpack({"model.gguf": GGUF})
    image = oras({"notes.txt": b"not a model"})
    repo = registry.repo("index")
    built, digest = push_index(
        registry,
        repo,
        "latest",
        [(model, {"artifactType": MODEL_ARTIFACT}), (image, {"platform": {"architecture": "amd64", "os": "linux"}})],
    )
    assert digest == built.digest
    status, headers, body = request(f"{registry.url}/v2/{repo}/manifests/latest", headers={"Accept": MANIFEST_ACCEPT})
    assert (status, headers["content-type"], headers["docker-content-digest"]) == (200, OCI_INDEX, digest)
    entries = json.loads(body)["manifests"]
    assert [e["digest"] for e in entries] == [model.digest, image.digest]
    assert entries[0]["artifactType"] == MODEL_ARTIFACT and "platform" not in entries[0]
    assert entries[1]["platform"] == {"architecture": "amd64", "os": "linux"}
    for child in (model, image):
        status, _, body = request(
            f"{registry.url}/v2/{repo}/manifests/{child.digest}", headers={"Accept": OCI_MANIFEST}
        )
        assert status == 200 and body == child.manifest_bytes()


def test_manifest_get_needs_an_accept_that_names_it(registry: Registry) -> None:
    """distribution 2.8.2 answers 404 MANIFEST_UNKNOWN for an OCI manifest asked for without its media type in
    ``Accept`` (by tag or digest; no Accept at all included), and 400 MANIFEST_INVALID for a schema 2 manifest asked
    for by tag without its type (it tries to rewrite it as schema 1); by digest that one comes back as is."""
    repo = registry.repo("accept")
    oci = oras({"a.bin": b"a"})
    docker = ollama(GGUF)
    push(registry, repo, "oci", oci)
    push(registry, repo, "docker", docker)
    for ref in ("oci", oci.digest):
        for accept in (None, DOCKER_MANIFEST):
            headers = {"Accept": accept} if accept else {}
            status, _, body = request(f"{registry.url}/v2/{repo}/manifests/{ref}", headers=headers)
            assert status == 404
            assert json.loads(body)["errors"][0]["code"] == "MANIFEST_UNKNOWN"
    for accept in (None, "*/*"):
        status, _, body = request(
            f"{registry.url}/v2/{repo}/manifests/docker", headers={"Accept": accept} if accept else {}
        )
        assert status == 400 and json.loads(body)["errors"][0]["code"] == "MANIFEST_INVALID"
    status, headers, body = request(f"{registry.url}/v2/{repo}/manifests/{docker.digest}")
    assert (status, headers["content-type"], body) == (200, DOCKER_MANIFEST, docker.manifest_bytes())


def test_manifest_size_limit(registry: Registry) -> None:
    """A manifest PUT over 4 MiB is refused (400 MANIFEST_INVALID, "http: request body too large")."""
    small = oras({"a.bin": b"a"})
    repo = registry.repo("big")
    push(registry, repo, "small", small)
    for size, accepted in ((4 * 1024 * 1024 - 4096, True), (4 * 1024 * 1024 + 1, False)):
        manifest = dict(small.manifest, annotations={"padding": ""})
        manifest["annotations"]["padding"] = "x" * (size - len(go_json(manifest)))
        big = Artifact(manifest, OCI_MANIFEST, small.blobs)
        assert len(big.manifest_bytes()) == size
        status, _, body = request(
            f"{registry.url}/v2/{repo}/manifests/v{size}",
            "PUT",
            {"Content-Type": OCI_MANIFEST},
            big.manifest_bytes(),
        )
        if accepted:
            assert status == 201
        else:
            assert status == 400 and b"request body too large" in body


def test_blob_head_and_ranges(registry: Registry) -> None:
    artifact = oras({"weights.bin": WEIGHTS})
    repo = registry.repo("range")
    push(registry, repo, "v1", artifact)
    blob = f"{registry.url}/v2/{repo}/blobs/{artifact.layers[0]['digest']}"
    status, headers, body = request(blob, "HEAD")
    assert (status, headers["accept-ranges"], headers["content-length"], body) == (200, "bytes", str(len(WEIGHTS)), b"")
    assert headers["docker-content-digest"] == artifact.layers[0]["digest"]
    for header, first, last in (
        ("bytes=1000-1999", 1000, 1999),
        ("bytes=16000-", 16000, 16383),
        ("bytes=-10", 16374, 16383),
    ):
        status, headers, body = request(blob, headers={"Range": header})
        assert status == 206
        assert headers["content-range"] == f"bytes {first}-{last}/{len(WEIGHTS)}"
        assert body == WEIGHTS[first : last + 1]


def test_unsatisfiable_range_answer_is_malformed(registry: Registry) -> None:
    """A quirk a client must survive: 2.8.2's 416 keeps the blob's Content-Length (16384) over a 33-byte body, so
    its connection cannot be reused; ``Content-Range: bytes */SIZE`` is right."""
    artifact = oras({"weights.bin": WEIGHTS})
    repo = registry.repo("range416")
    push(registry, repo, "v1", artifact)
    with socket.create_connection(("127.0.0.1", registry.port), timeout=5) as sock:
        path = f"/v2/{repo}/blobs/{artifact.layers[0]['digest']}"
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nRange: bytes=99999-\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert lines[0].split(" ")[1] == "416"
    assert headers["content-range"] == f"bytes */{len(WEIGHTS)}"
    assert headers["content-length"] == str(len(WEIGHTS))
    assert body == b"invalid range: failed to overlap\n"


def _listening_addresses(pid: int) -> set[str]:
    """host:port of every listening TCP socket the process holds (from /proc, no tool needed)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                host = ".".join(str(b) for b in reversed(bytes.fromhex(address))) if len(address) == 8 else address
                found.add(f"{host}:{int(port, 16)}")
    return found


def test_registry_listens_on_loopback_only(registry: Registry) -> None:
    assert registry.pid is not None
    assert _listening_addresses(registry.pid) == {registry.host}


def test_local_layouts_parse_back(tmp_path: Path) -> None:
    model = modelpack({"model.safetensors": WEIGHTS, "config.json": b"{}"})
    other = oras({"model.gguf": GGUF})
    both = index([(model, {"artifactType": MODEL_ARTIFACT})])
    layout = write_oci_layout(tmp_path / "layout", {"v1": model, "gguf": other, "multi": both})
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    listed = json.loads((layout / "index.json").read_text())
    assert listed["schemaVersion"] == 2 and listed["mediaType"] == OCI_INDEX
    refs = {entry["annotations"][REF_NAME]: entry for entry in listed["manifests"]}
    assert {ref: entry["digest"] for ref, entry in refs.items()} == {
        "v1": model.digest,
        "gguf": other.digest,
        "multi": both.digest,
    }
    for path in (layout / "blobs" / "sha256").iterdir():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == path.name
    manifest = json.loads((layout / "blobs" / "sha256" / refs["v1"]["digest"][7:]).read_bytes())
    for descriptor in [manifest["config"], *manifest["layers"]]:
        assert (layout / "blobs" / "sha256" / descriptor["digest"][7:]).stat().st_size == descriptor["size"]

    llama = ollama(GGUF, license="MIT")
    models = write_ollama_models(
        tmp_path / "ollama",
        {"registry.ollama.ai/library/llama3.2/1b": llama, "registry.ollama.ai/someone/tiny/latest": ollama(b"GGUF")},
    )
    manifest_file = models / "manifests" / "registry.ollama.ai" / "library" / "llama3.2" / "1b"
    assert manifest_file.read_bytes() == llama.manifest_bytes()
    assert (models / "manifests" / "registry.ollama.ai" / "someone" / "tiny" / "latest").is_file()
    stored = json.loads(manifest_file.read_bytes())
    assert stored["mediaType"] == DOCKER_MANIFEST and stored["layers"][0]["mediaType"] == OLLAMA_MODEL
    for descriptor in [stored["config"], *stored["layers"]]:
        blob = models / "blobs" / descriptor["digest"].replace(":", "-")
        assert blob.name.startswith("sha256-") and hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name[7:]
    assert (models / "blobs" / stored["layers"][0]["digest"].replace(":", "-")).read_bytes() == GGUF


# --- builders ---------------------------------------------------------------------------------------------


def test_modelpack_layout() -> None:
    files = {"model.safetensors": WEIGHTS, "config.json": b"{}", "LICENSE": b"MIT", "sub/run.py": b"print()"}
    raw = modelpack(files, annotations={"org.cncf.model.name": "t"})
    manifest = raw.manifest
    assert (manifest["mediaType"], manifest["artifactType"]) == (OCI_MANIFEST, MODEL_ARTIFACT)
    assert manifest["config"]["mediaType"] == MODEL_CONFIG
    kinds = [(layer["mediaType"], layer["annotations"][FILEPATH]) for layer in manifest["layers"]]
    assert kinds == [
        ("application/vnd.cncf.model.weight.config.v1.raw", "config.json"),
        ("application/vnd.cncf.model.weight.v1.raw", "model.safetensors"),
        ("application/vnd.cncf.model.code.v1.raw", "sub/run.py"),
        ("application/vnd.cncf.model.doc.v1.raw", "LICENSE"),
    ]
    assert raw.layer_bytes(1) == WEIGHTS
    metadata = json.loads(manifest["layers"][2]["annotations"][FILE_METADATA])
    assert metadata["name"] == "run.py" and metadata["size"] == 7 and metadata["typeflag"] == 0
    config = json.loads(raw.blobs[manifest["config"]["digest"]])
    assert config["modelfs"] == {"type": "layers", "diffIds": [layer["digest"] for layer in manifest["layers"]]}
    assert config["config"]["format"] == "safetensors"
    assert manifest["annotations"] == {"org.cncf.model.name": "t"}
    # Go's encoding/json: compact, fields in struct order.
    assert raw.manifest_bytes().startswith(b'{"schemaVersion":2,"mediaType":"' + OCI_MANIFEST.encode())

    packed = modelpack({"weights/model.safetensors": WEIGHTS}, tar=True)
    layer = packed.layers[0]
    assert layer["mediaType"] == "application/vnd.cncf.model.weight.v1.tar"
    blob = packed.layer_bytes(0)
    offset, size = tar_members(blob)["weights/model.safetensors"]
    assert blob[offset : offset + size] == WEIGHTS
    squeezed = modelpack({"model.safetensors": WEIGHTS}, compressed=True)
    assert squeezed.layers[0]["mediaType"] == "application/vnd.cncf.model.weight.v1.tar+gzip"
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(squeezed.layer_bytes(0)))) as opened:
        assert opened.getnames() == ["model.safetensors"]


def test_oras_layout() -> None:
    artifact = oras({"model.gguf": GGUF}, {"shards": {"index.json": b"{}", "a/part-1.bin": WEIGHTS}})
    manifest = artifact.manifest
    assert manifest["artifactType"] == "application/vnd.unknown.artifact.v1"
    assert manifest["config"] == {
        "mediaType": "application/vnd.oci.empty.v1+json",
        "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",
        "size": 2,
        "data": "e30=",
    }
    file_layer, folder_layer = manifest["layers"]
    assert file_layer == {
        "mediaType": "application/vnd.oci.image.layer.v1.tar",
        "digest": "sha256:" + hashlib.sha256(GGUF).hexdigest(),
        "size": len(GGUF),
        "annotations": {TITLE: "model.gguf"},
    }
    assert folder_layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    assert folder_layer["annotations"][TITLE] == "shards" and folder_layer["annotations"][UNPACK] == "true"
    archive = gzip.decompress(artifact.blobs[folder_layer["digest"]])
    assert folder_layer["annotations"]["io.deis.oras.content.digest"] == "sha256:" + hashlib.sha256(archive).hexdigest()
    with tarfile.open(fileobj=io.BytesIO(archive)) as opened:
        assert opened.getnames() == ["shards", "shards/index.json", "shards/a", "shards/a/part-1.bin"]
    offset, size = tar_members(archive)["shards/a/part-1.bin"]
    assert archive[offset : offset + size] == WEIGHTS
    plain = oras({}, {"shards": {"x.bin": b"x"}}, folder_gzip=False, artifact_type="application/x-test")
    assert plain.layers[0]["mediaType"] == "application/vnd.oci.image.layer.v1.tar"
    assert plain.manifest["artifactType"] == "application/x-test"
    assert plain.layers[0]["annotations"]["io.deis.oras.content.digest"] == plain.layers[0]["digest"]


def test_ollama_and_docker_model_runner_layouts() -> None:
    model = ollama(GGUF, template="{{ .Prompt }}", params={"stop": ["<|eot_id|>"]}, system="S", license="L")
    manifest = model.manifest
    assert (manifest["mediaType"], manifest["config"]["mediaType"]) == (DOCKER_MANIFEST, OLLAMA_CONFIG)
    assert [layer["mediaType"].rsplit(".", 1)[1] for layer in manifest["layers"]] == [
        "model",
        "template",
        "system",
        "license",
        "params",
    ]
    config = json.loads(model.blobs[manifest["config"]["digest"]])
    assert config["model_format"] == "gguf" and config["model_families"] == [config["model_family"]]
    assert config["rootfs"]["diff_ids"] == [layer["digest"] for layer in manifest["layers"]]
    params = model.layer_bytes(4)
    assert params == b'{"stop":["\\u003c|eot_id|\\u003e"]}' and json.loads(params) == {"stop": ["<|eot_id|>"]}

    dmr = docker_model_runner(gguf=GGUF, license="MIT")
    assert dmr.manifest["config"]["mediaType"] == "application/vnd.docker.ai.model.config.v0.1+json"
    assert [layer["mediaType"] for layer in dmr.layers] == [DMR_GGUF, DMR_LICENSE]
    assert dmr.layers[0]["annotations"][FILEPATH] == "model.gguf" and dmr.layer_bytes(0) == GGUF
    assert "annotations" not in docker_model_runner(gguf=GGUF, annotated=False).layers[0]


def test_tar_helpers() -> None:
    name, archive = long_name_tar(WEIGHTS)
    assert len(name) > 100
    # A PAX extended header ('x') carries the path; the ustar name field cannot hold it.
    assert archive[156:157] == b"x" and f"path={name}".encode() in archive[512:1024]
    offset, size = tar_members(archive)[name]
    assert archive[offset : offset + size] == WEIGHTS
    shards = {
        "model.safetensors.index.json": b"{}",
        "model-00001-of-00002.safetensors": b"1",
        "model-00002-of-00002.safetensors": b"22",
    }
    members = tar_members(folder_tar("model", shards))
    assert sorted(members) == sorted(f"model/{n}" for n in shards)
    assert go_json({"a": "<&>"}) == b'{"a":"\\u003c\\u0026\\u003e"}'


# --- token auth -------------------------------------------------------------------------------------------


def test_anonymous_request_gets_a_bearer_challenge(token_registry: TokenRegistry) -> None:
    repo = token_registry.repo("private")
    status, headers, _ = request(
        f"{token_registry.url}/v2/{repo}/manifests/latest", headers={"Accept": MANIFEST_ACCEPT}
    )
    assert status == 401
    params = challenge(headers["www-authenticate"])
    assert params == {
        "realm": token_registry.issuer.realm,
        "service": Registry.SERVICE,
        "scope": f"repository:{repo}:pull",
    }
    status, headers, _ = request(f"{token_registry.url}/v2/")
    assert status == 401 and challenge(headers["www-authenticate"])["realm"] == token_registry.issuer.realm


def test_token_with_credentials_pushes_and_pulls(token_registry: TokenRegistry) -> None:
    repo = token_registry.repo("private")
    artifact = modelpack({"model.safetensors": WEIGHTS})
    assert (
        push(token_registry.registry, repo, "v1", artifact, credentials=token_registry.credentials) == artifact.digest
    )
    assert all(user == token_registry.user for user, _ in token_registry.issuer.issued)
    status, answer = token_for(token_registry, f"repository:{repo}:pull", token_registry.credentials)
    assert status == 200 and answer["token"] == answer["access_token"]
    assert answer["expires_in"] == token_registry.issuer.expires_in and answer["issued_at"].endswith("Z")
    header, claims = decode_jwt(answer["token"])
    assert header["alg"] == "ES256" and len(header["x5c"]) == 1
    assert claims["aud"] == Registry.SERVICE and claims["sub"] == token_registry.user
    assert claims["access"] == [{"type": "repository", "name": repo, "actions": ["pull"]}]
    bearer = {"Authorization": f"Bearer {answer['token']}", "Accept": MANIFEST_ACCEPT}
    status, headers, body = request(f"{token_registry.url}/v2/{repo}/manifests/v1", headers=bearer)
    assert (status, headers["docker-content-digest"], body) == (200, artifact.digest, artifact.manifest_bytes())
    bearer["Range"] = "bytes=100-199"
    status, _, body = request(f"{token_registry.url}/v2/{repo}/blobs/{artifact.layers[0]['digest']}", headers=bearer)
    assert (status, body) == (206, WEIGHTS[100:200])
    assert token_registry.issuer.issued[-1] == (token_registry.user, f"repository:{repo}:pull")
    assert all("password" not in str(entry).lower() for entry in token_registry.issuer.requests)


def test_anonymous_pull_of_a_public_repository_only(token_registry: TokenRegistry) -> None:
    artifact = oras({"model.gguf": GGUF})
    push(token_registry.registry, token_registry.public_repo, "v1", artifact, credentials=token_registry.credentials)
    private = token_registry.repo("private")
    push(token_registry.registry, private, "v1", artifact, credentials=token_registry.credentials)
    token_registry.issuer.clear()
    status, answer = token_for(token_registry, f"repository:{token_registry.public_repo}:pull,push")
    assert status == 200
    assert decode_jwt(answer["token"])[1]["access"][0]["actions"] == ["pull"]
    headers = {"Authorization": f"Bearer {answer['token']}", "Accept": MANIFEST_ACCEPT}
    status, _, body = request(f"{token_registry.url}/v2/{token_registry.public_repo}/manifests/v1", headers=headers)
    assert (status, body) == (200, artifact.manifest_bytes())

    status, answer = token_for(token_registry, f"repository:{private}:pull")
    assert status == 200 and decode_jwt(answer["token"])[1]["access"][0]["actions"] == []
    headers["Authorization"] = f"Bearer {answer['token']}"
    status, answer_headers, _ = request(f"{token_registry.url}/v2/{private}/manifests/v1", headers=headers)
    assert status == 401 and 'error="insufficient_scope"' in answer_headers["www-authenticate"]
    assert [user for user, _ in token_registry.issuer.issued] == [None, None]


def test_wrong_credentials_are_refused_by_the_token_endpoint(token_registry: TokenRegistry) -> None:
    for credentials in ((token_registry.user, "wrong"), ("nobody", token_registry.password)):
        status, _ = token_for(token_registry, "repository:stfs/x:pull", credentials)
        assert status == 401
    assert token_registry.issuer.tokens_issued == 0
    assert [entry["status"] for entry in token_registry.issuer.requests] == ["401", "401"]
    with pytest.raises(PermissionError):
        push(token_registry.registry, token_registry.repo(), "v1", oras({"a": b"a"}), credentials=("nobody", "x"))


def test_an_expired_token_is_refused(token_registry: TokenRegistry) -> None:
    repo = token_registry.repo("expiry")
    artifact = oras({"model.gguf": GGUF})
    push(token_registry.registry, repo, "v1", artifact, credentials=token_registry.credentials)
    token_registry.issuer.expires_in = 2
    status, answer = token_for(token_registry, f"repository:{repo}:pull", token_registry.credentials)
    assert status == 200 and answer["expires_in"] == 2
    headers = {"Authorization": f"Bearer {answer['token']}", "Accept": MANIFEST_ACCEPT}
    url = f"{token_registry.url}/v2/{repo}/manifests/v1"
    assert request(url, headers=headers)[0] == 200
    time.sleep(2.5)
    status, answer_headers, _ = request(url, headers=headers)
    assert status == 401 and 'error="invalid_token"' in answer_headers["www-authenticate"]


# --- the blob redirector ----------------------------------------------------------------------------------


def test_redirector_sends_blob_reads_to_the_cdn(registry: Registry, blob_redirector: BlobRedirector) -> None:
    artifact = oras({"weights.bin": WEIGHTS})
    repo = registry.repo("redirect")
    push(registry, repo, "v1", artifact)
    status, headers, body = request(
        f"{blob_redirector.url}/v2/{repo}/manifests/v1", headers={"Accept": MANIFEST_ACCEPT}
    )
    assert (status, headers["docker-content-digest"], body) == (200, artifact.digest, artifact.manifest_bytes())
    digest = artifact.layers[0]["digest"]
    for method in ("GET", "HEAD"):
        status, headers, body = request(
            f"{blob_redirector.url}/v2/{repo}/blobs/{digest}", method, {"Range": "bytes=0-9"}
        )
        assert (status, body) == (307, b"")
        location = urlsplit(headers["location"])
        assert (location.hostname, location.port) == ("localhost", blob_redirector.cdn_port)
        assert location.path == f"/cdn/sha256/{digest[7:]}" and location.query.startswith("sig=")
    status, headers, body = request(headers["location"], headers={"Range": "bytes=4096-8191"})
    assert (status, headers["content-range"], body) == (206, f"bytes 4096-8191/{len(WEIGHTS)}", WEIGHTS[4096:8192])
    (seen,) = blob_redirector.cdn_requests()
    assert seen.headers["range"] == "bytes=4096-8191" and "authorization" not in seen.headers
    assert (seen.status, seen.body) == (206, WEIGHTS[4096:8192])
    status, _, _ = request(f"{blob_redirector.url}/v2/{repo}/blobs/sha256:{'0' * 64}")
    assert status == 404


def test_cdn_ranges_and_keep_alive(registry: Registry, blob_redirector: BlobRedirector) -> None:
    artifact = oras({"weights.bin": WEIGHTS})
    repo = registry.repo("cdn")
    push(registry, repo, "v1", artifact)
    hexdigest = artifact.layers[0]["digest"][7:]
    path = f"/cdn/sha256/{hexdigest}?sig={blob_redirector.signature(hexdigest)}"
    connection = http.client.HTTPConnection("localhost", blob_redirector.cdn_port, timeout=10)
    try:
        answers = []
        for header in ("bytes=0-0", "bytes=16380-", "bytes=-4", "bytes=20000-", None):
            connection.request("GET", path, headers={"Range": header} if header else {})
            response = connection.getresponse()
            answers.append((response.status, response.getheader("Content-Range"), response.read()))
    finally:
        connection.close()
    size = len(WEIGHTS)
    assert answers == [
        (206, f"bytes 0-0/{size}", WEIGHTS[:1]),
        (206, f"bytes 16380-16383/{size}", WEIGHTS[16380:]),
        (206, f"bytes 16380-16383/{size}", WEIGHTS[-4:]),
        (416, f"bytes */{size}", b""),
        (200, None, WEIGHTS),
    ]
    assert len(blob_redirector.cdn_requests()) == 5  # all on one connection
    status, _, _ = request(f"{blob_redirector.cdn_url}/cdn/sha256/{hexdigest}?sig=forged")
    assert status == 403


def test_redirector_passes_the_registry_401_on(
    token_registry: TokenRegistry, token_blob_redirector: BlobRedirector
) -> None:
    repo = token_registry.repo("redirect-auth")
    artifact = oras({"weights.bin": WEIGHTS})
    push(token_registry.registry, repo, "v1", artifact, credentials=token_registry.credentials)
    blob = f"{token_blob_redirector.url}/v2/{repo}/blobs/{artifact.layers[0]['digest']}"
    status, headers, _ = request(blob)
    assert status == 401 and challenge(headers["www-authenticate"])["scope"] == f"repository:{repo}:pull"
    assert token_blob_redirector.redirects == 0
    _, answer = token_for(token_registry, f"repository:{repo}:pull", token_registry.credentials)
    status, headers, _ = request(blob, headers={"Authorization": f"Bearer {answer['token']}"})
    assert status == 307 and urlsplit(headers["location"]).hostname == "localhost"
    status, _, body = request(headers["location"], headers={"Range": "bytes=10-19"})
    assert (status, body) == (206, WEIGHTS[10:20])


def test_registry_auth_file(registry_auth_file: Any, registry: Registry) -> None:
    path = registry_auth_file(registry.host, "alice", "s3cret:with-colon")
    entry = json.loads(path.read_text())["auths"][registry.host]
    assert base64.b64decode(entry["auth"]).decode() == "alice:s3cret:with-colon"
    assert path.stat().st_mode & 0o777 == 0o600
