"""OCI registries for the ``oci://`` tests, all on 127.0.0.1: Debian's ``docker-registry`` (CNCF distribution 2.8.2),
a Docker token issuer, a reverse proxy that redirects blob reads to a "CDN", push helpers over plain HTTP, and
builders for the artifacts model tools push (ModelPack/modctl, ORAS, Ollama, Docker Model Runner) and the local
stores they write (an OCI image layout, ``~/.ollama/models``).

Servers follow ``tests/servers.py``: ``start()``/``stop()``, every wait has a deadline, ports from ``free_ports()``.
Builders are pure functions returning an ``Artifact`` laid out as the real tool lays it out (field order, annotations,
compact JSON as Go's ``encoding/json`` writes it), so a digest computed here is the digest the tool would push.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import gzip
import hashlib
import hmac
import http.client
import io
import json
import os
import re
import secrets
import subprocess
import tarfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from tests.servers import LOCALHOST, START_TIMEOUT, STOP_TIMEOUT, _stop_process, find_tool, free_port, wait_until

# --- media types ------------------------------------------------------------------------------------------

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST_ACCEPT = ", ".join((OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_MANIFEST_LIST))

MODEL_ARTIFACT = "application/vnd.cncf.model.manifest.v1+json"
MODEL_CONFIG = "application/vnd.cncf.model.config.v1+json"
FILEPATH = "org.cncf.model.filepath"
FILE_METADATA = "org.cncf.model.file.metadata+json"
MEDIATYPE_UNTESTED = "org.cncf.model.file.mediatype.untested"

ORAS_FILE = "application/vnd.oci.image.layer.v1.tar"
ORAS_FOLDER = "application/vnd.oci.image.layer.v1.tar+gzip"
ORAS_UNKNOWN_ARTIFACT = "application/vnd.unknown.artifact.v1"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"
TITLE = "org.opencontainers.image.title"
CREATED = "org.opencontainers.image.created"
REF_NAME = "org.opencontainers.image.ref.name"
UNPACK = "io.deis.oras.content.unpack"
CONTENT_DIGEST = "io.deis.oras.content.digest"

OLLAMA_CONFIG = "application/vnd.docker.container.image.v1+json"
OLLAMA_MODEL = "application/vnd.ollama.image.model"

DMR_CONFIG = "application/vnd.docker.ai.model.config.v0.1+json"
DMR_GGUF = "application/vnd.docker.ai.gguf.v3"
DMR_SAFETENSORS = "application/vnd.docker.ai.safetensors"
DMR_LICENSE = "application/vnd.docker.ai.license"

# Builders stamp this time where the tools stamp "now": the same inputs give the same digests.
FIXED_TIME = "2025-01-01T00:00:00Z"
FIXED_EPOCH = 1735689600


# --- JSON as Go writes it ---------------------------------------------------------------------------------


def go_json(value: Any) -> bytes:
    """``json.Marshal``'s bytes: compact, UTF-8, ``<``, ``>``, ``&``, U+2028 and U+2029 escaped (HTML-safe).

    Key order is the dicts' order: builders write structs in Go's field order and maps (annotations) sorted.
    """
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028")):
        text = text.replace(char, escaped)
    return text.replace("\u2029", "\\u2029").encode()


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _descriptor(media_type: str, data: bytes, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """An OCI descriptor in Go's field order (mediaType, digest, size, urls, annotations, data, platform, …)."""
    found: dict[str, Any] = {"mediaType": media_type, "digest": sha256_digest(data), "size": len(data)}
    if annotations:
        found["annotations"] = dict(sorted(annotations.items()))
    return found


@dataclass(frozen=True, slots=True)
class Artifact:
    """A manifest (or index) and the blobs it names: what a tool pushes, or writes in a local store."""

    manifest: dict[str, Any]
    media_type: str
    blobs: dict[str, bytes]  # "sha256:HEX" -> bytes: config and layers (an index: none)
    children: tuple[Artifact, ...] = ()  # an index's manifests
    raw: bytes | None = field(default=None, repr=False)  # exact manifest bytes when not go_json(manifest)

    def manifest_bytes(self) -> bytes:
        """The exact bytes pushed and written: the digest is theirs."""
        return self.raw if self.raw is not None else go_json(self.manifest)

    @property
    def digest(self) -> str:
        return sha256_digest(self.manifest_bytes())

    @property
    def layers(self) -> list[dict[str, Any]]:
        return list(self.manifest.get("layers", []))

    def descriptor(self, **extra: Any) -> dict[str, Any]:
        """This manifest's descriptor, with ``platform``/``artifactType``/``annotations`` given as ``extra``."""
        found: dict[str, Any] = {
            "mediaType": self.media_type,
            "digest": self.digest,
            "size": len(self.manifest_bytes()),
        }
        for key in ("annotations", "platform", "artifactType"):
            if extra.get(key):
                found[key] = extra[key]
        return found

    def layer_bytes(self, index: int) -> bytes:
        return self.blobs[self.layers[index]["digest"]]

    def all_blobs(self) -> dict[str, bytes]:
        """Every blob, children's included (what a store of this artifact holds besides manifests)."""
        found = dict(self.blobs)
        for child in self.children:
            found.update(child.all_blobs())
        return found


# --- tars -------------------------------------------------------------------------------------------------


def _tar_info(name: str, size: int = 0, directory: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = FIXED_EPOCH
    info.mode = 0o755 if directory else 0o644
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def make_tar(files: dict[str, bytes], directories: bool = False) -> bytes:
    """A deterministic tar (PAX format, as Go's ``archive/tar`` writes when a name needs it) of ``files`` at their
    paths, in the given order; ``directories`` adds an entry for each parent folder before its files."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as archive:
        seen: set[str] = set()
        for name, data in files.items():
            if directories:
                parts = name.split("/")[:-1]
                for depth in range(1, len(parts) + 1):
                    folder = "/".join(parts[:depth])
                    if folder not in seen:
                        seen.add(folder)
                        archive.addfile(_tar_info(folder, directory=True))
            archive.addfile(_tar_info(name, len(data)), io.BytesIO(data))
    return out.getvalue()


def long_name_tar(data: bytes, name: str | None = None) -> tuple[str, bytes]:
    """(member path over 100 characters, a tar holding ``data`` at it): the path needs a PAX ``path`` record."""
    name = name or "weights/" + "a-very-long-shard-name-" * 5 + "model-00001-of-00001.safetensors"
    if len(name.encode()) <= 100:
        raise ValueError("a PAX long name is over 100 bytes")
    return name, make_tar({name: data})


def folder_tar(folder: str, files: dict[str, bytes]) -> bytes:
    """A folder as ``oras push FOLDER`` tars it: an entry for the folder, then its files under ``FOLDER/``."""
    return make_tar({f"{folder}/{path}": data for path, data in files.items()}, directories=True)


def tar_members(data: bytes) -> dict[str, tuple[int, int]]:
    """Each regular member of a tar: name -> (offset of its bytes in the tar, size)."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        return {m.name: (m.offset_data, m.size) for m in archive.getmembers() if m.isreg()}


def _gzip(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=3, write_checksum=True).compress(data)  # one frame, as modctl writes it


# --- artifact builders ------------------------------------------------------------------------------------

_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".gguf",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".onnx",
    ".onnx_data",
    ".distcp",
    ".h5",
    ".msgpack",
    ".pkl",
    ".model",
)
_CONFIG_NAMES = ("vocab.txt", "merges.txt", "added_tokens.txt", "chat_template.jinja", "tokenizer.model")
_CONFIG_SUFFIXES = (".json", ".jsonl", ".yaml", ".yml", ".toml", ".ini", ".cfg", ".conf", ".params", ".tiktoken")
_DOC_SUFFIXES = (".md", ".txt", ".rst", ".pdf", ".html")
_CODE_SUFFIXES = (".py", ".sh", ".ipynb", ".c", ".cpp", ".h", ".cu", ".js", ".go", ".rs")


def modelpack_kind(path: str) -> str:
    """The ModelPack layer kind modctl's file patterns give a path: weight.config, weight, code or doc."""
    base = path.rsplit("/", 1)[-1]
    lower = base.lower()
    if base in _CONFIG_NAMES or "tokenizer.model" in lower or lower.endswith(_CONFIG_SUFFIXES):
        return "weight.config"
    if lower.endswith(_WEIGHT_SUFFIXES) or re.search(r"\.(bin|gguf|safetensors)\.", lower):
        return "weight"
    if lower.startswith(("readme", "license", "licence", "notice", "copying")) or lower.endswith(_DOC_SUFFIXES):
        return "doc"
    if lower.endswith(_CODE_SUFFIXES):
        return "code"
    raise ValueError(f"{path}: modctl has no pattern for this file")


def _weight_format(paths: list[str]) -> str:
    for suffix, name in (
        (".safetensors", "safetensors"),
        (".gguf", "gguf"),
        (".onnx", "onnx"),
        (".bin", "pytorch"),
        (".pt", "pytorch"),
        (".pth", "pytorch"),
    ):
        if any(p.endswith(suffix) for p in paths):
            return name
    return ""


def _file_metadata(path: str, size: int) -> str:
    # modelspec.FileMetadata as json.Marshal writes it (time.Time as RFC 3339).
    value = {"name": path.rsplit("/", 1)[-1], "mode": 0o644, "uid": 0, "gid": 0, "size": size}
    value.update({"mtime": FIXED_TIME, "typeflag": 0})
    return go_json(value).decode()


def modelpack(
    files: dict[str, bytes],
    tar: bool = False,
    compressed: bool | str = False,
    annotations: dict[str, str] | None = None,
    name: str = "test-model",
    family: str = "llama",
) -> Artifact:
    """A model as ``modctl build`` + ``push`` lays it out: one layer per file, ``org.cncf.model.filepath`` and
    ``org.cncf.model.file.metadata+json`` on each; config layers first, then weights, code, docs (modctl's
    processors' order), each group by path. ``tar`` packs each file in a tar at its path (``--raw=false``),
    ``compressed`` gzips that tar (``….v1.tar+gzip``), ``"zstd"`` makes it one zstd frame (``….v1.tar+zstd``)."""
    order = ("weight.config", "weight", "code", "doc")
    kinds = {path: modelpack_kind(path) for path in files}
    compression = "zstd" if compressed == "zstd" else "gzip"
    suffix = (f"tar+{compression}" if compressed else "tar") if tar or compressed else "raw"
    layers = []
    blobs: dict[str, bytes] = {}
    for path in sorted(files, key=lambda p: (order.index(kinds[p]), p)):
        data = files[path]
        blob = data if suffix == "raw" else make_tar({path: data})
        if compressed:
            blob = _zstd(blob) if compression == "zstd" else _gzip(blob)
        media_type = f"application/vnd.cncf.model.{kinds[path]}.v1.{suffix}"
        layers.append(_descriptor(media_type, blob, {FILEPATH: path, FILE_METADATA: _file_metadata(path, len(data))}))
        blobs[sha256_digest(blob)] = blob
    technical = {"architecture": "transformer", "format": _weight_format(list(files))}
    config = {
        "descriptor": {"createdAt": FIXED_TIME, "family": family, "name": name},
        "modelfs": {"type": "layers", "diffIds": [layer["digest"] for layer in layers]},
        "config": {key: value for key, value in technical.items() if value},  # Go's omitempty
    }
    config_bytes = go_json(config)
    blobs[sha256_digest(config_bytes)] = config_bytes
    manifest: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": MODEL_ARTIFACT,
        "config": _descriptor(MODEL_CONFIG, config_bytes),
        "layers": layers,
    }
    if annotations:
        manifest["annotations"] = dict(sorted(annotations.items()))
    return Artifact(manifest, OCI_MANIFEST, blobs)


def oras(
    files: dict[str, bytes],
    folders: dict[str, dict[str, bytes]] | None = None,
    folder_gzip: bool = True,
    artifact_type: str | None = None,
) -> Artifact:
    """What ``oras push REF FILE… FOLDER…`` pushes (OCI 1.1 manifest): each file a layer
    ``application/vnd.oci.image.layer.v1.tar`` holding its bytes untouched, titled with its name; each folder a
    tar (gzipped unless ``folder_gzip=False``) titled with the folder's name, ``io.deis.oras.content.unpack: "true"``
    and ``io.deis.oras.content.digest`` (the tar's digest before gzip); the empty config ``{}``."""
    layers = []
    blobs: dict[str, bytes] = {}
    for name, data in files.items():
        layers.append(_descriptor(ORAS_FILE, data, {TITLE: name}))
        blobs[sha256_digest(data)] = data
    for name, members in (folders or {}).items():
        archive = folder_tar(name, members)
        blob = _gzip(archive) if folder_gzip else archive
        media_type = ORAS_FOLDER if folder_gzip else ORAS_FILE
        notes = {TITLE: name, UNPACK: "true", CONTENT_DIGEST: sha256_digest(archive)}
        layers.append(_descriptor(media_type, blob, notes))
        blobs[sha256_digest(blob)] = blob
    empty = b"{}"
    blobs[sha256_digest(empty)] = empty
    config = _descriptor(OCI_EMPTY, empty)
    config["data"] = base64.b64encode(empty).decode()  # oras-go's DescriptorEmptyJSON carries its bytes
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": artifact_type or ORAS_UNKNOWN_ARTIFACT,
        "config": config,
        "layers": layers,
        "annotations": {CREATED: FIXED_TIME},
    }
    return Artifact(manifest, OCI_MANIFEST, blobs)


def ollama(
    model: bytes,
    template: str = "{{ .System }}\n{{ .Prompt }}",
    params: dict[str, Any] | None = None,
    system: str | None = None,
    license: str | None = None,
    family: str = "llama",
    file_type: str = "Q8_0",
    model_type: str = "1B",
) -> Artifact:
    """A model as ``ollama create`` + ``push`` (and registry.ollama.ai) lays it out: Docker schema 2 manifest,
    config ``application/vnd.docker.container.image.v1+json`` (model_format gguf, family, file_type, rootfs),
    layers ``application/vnd.ollama.image.model`` (the GGUF), ``.template``, ``.system``, ``.license``,
    ``.params`` (JSON)."""
    parts: list[tuple[str, bytes]] = [(OLLAMA_MODEL, model)]
    if template:
        parts.append(("application/vnd.ollama.image.template", template.encode()))
    if system is not None:
        parts.append(("application/vnd.ollama.image.system", system.encode()))
    if license is not None:
        parts.append(("application/vnd.ollama.image.license", license.encode()))
    if params is not None:
        parts.append(("application/vnd.ollama.image.params", go_json(params)))
    layers = [_descriptor(media_type, data) for media_type, data in parts]
    blobs = {sha256_digest(data): data for _, data in parts}
    config = {
        "model_format": "gguf",
        "model_family": family,
        "model_families": [family],
        "model_type": model_type,
        "file_type": file_type,
        "architecture": "amd64",
        "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [layer["digest"] for layer in layers]},
    }
    config_bytes = go_json(config)
    blobs[sha256_digest(config_bytes)] = config_bytes
    manifest = {
        "schemaVersion": 2,
        "mediaType": DOCKER_MANIFEST,
        "config": _descriptor(OLLAMA_CONFIG, config_bytes),
        "layers": layers,
    }
    return Artifact(manifest, DOCKER_MANIFEST, blobs)


def docker_model_runner(
    gguf: bytes | None = None,
    safetensors: bytes | None = None,
    license: str | bytes | None = None,
    annotated: bool = True,
    gguf_name: str = "model.gguf",
    safetensors_name: str = "model.safetensors",
) -> Artifact:
    """A model as ``docker model package``/``push`` lays it out (config v0.1): layers
    ``application/vnd.docker.ai.gguf.v3`` / ``.safetensors`` / ``.license``; each annotated with
    ``org.cncf.model.filepath`` (the file's base name), file metadata and ``mediatype.untested: "false"`` as
    model-runner's layers are; ``annotated=False`` gives the older layout without annotations (Docker Hub's
    first ``ai/`` models)."""
    parts: list[tuple[str, str, bytes]] = []
    if gguf is not None:
        parts.append((DMR_GGUF, gguf_name, gguf))
    if safetensors is not None:
        parts.append((DMR_SAFETENSORS, safetensors_name, safetensors))
    if license is not None:
        parts.append((DMR_LICENSE, "LICENSE", license.encode() if isinstance(license, str) else license))
    if not parts:
        raise ValueError("a model needs gguf or safetensors bytes")
    layers = []
    for media_type, name, data in parts:
        notes = None
        if annotated:
            notes = {FILEPATH: name, FILE_METADATA: _file_metadata(name, len(data)), MEDIATYPE_UNTESTED: "false"}
        layers.append(_descriptor(media_type, data, notes))
    blobs = {sha256_digest(data): data for _, _, data in parts}
    size = f"{sum(len(data) for _, _, data in parts)} B"
    config = {
        "config": {"format": "gguf" if gguf is not None else "safetensors", "quantization": "Q8_0", "size": size},
        "descriptor": {"created": FIXED_TIME},
        "rootfs": {"type": "layers", "diff_ids": [layer["digest"] for layer in layers]},
    }
    config_bytes = go_json(config)
    blobs[sha256_digest(config_bytes)] = config_bytes
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": _descriptor(DMR_CONFIG, config_bytes),
        "layers": layers,
    }
    return Artifact(manifest, OCI_MANIFEST, blobs)


def index(entries: list[tuple[Artifact, dict[str, Any]]], annotations: dict[str, str] | None = None) -> Artifact:
    """An OCI image index of the artifacts; each entry's dict gives its descriptor's ``platform``,
    ``artifactType`` and/or ``annotations``."""
    manifest: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [artifact.descriptor(**extra) for artifact, extra in entries],
    }
    if annotations:
        manifest["annotations"] = dict(sorted(annotations.items()))
    return Artifact(manifest, OCI_INDEX, {}, children=tuple(artifact for artifact, _ in entries))


# --- local stores -----------------------------------------------------------------------------------------


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def write_oci_layout(folder: Path, artifacts: dict[str, Artifact]) -> Path:
    """An OCI image layout as ``oras pull --oci-layout`` and skopeo write it: ``oci-layout``, ``index.json``
    listing each manifest with ``org.opencontainers.image.ref.name``, every blob (manifests too) at
    ``blobs/sha256/HEX``. Returns ``folder``."""
    folder = Path(folder)
    _write(folder / "oci-layout", go_json({"imageLayoutVersion": "1.0.0"}))
    listed = []
    for ref, artifact in artifacts.items():
        stack = [artifact]
        while stack:
            current = stack.pop()
            _write(folder / "blobs" / "sha256" / current.digest.split(":", 1)[1], current.manifest_bytes())
            for digest, data in current.blobs.items():
                _write(folder / "blobs" / "sha256" / digest.split(":", 1)[1], data)
            stack.extend(current.children)
        listed.append(artifact.descriptor(annotations={REF_NAME: ref}))
    _write(folder / "index.json", go_json({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": listed}))
    return folder


def write_ollama_models(folder: Path, models: dict[str, Artifact]) -> Path:
    """``~/.ollama/models`` as Ollama leaves it after pulls: ``manifests/HOST/NAMESPACE/MODEL/TAG`` holding the
    manifest's bytes as the registry sent them, ``blobs/sha256-HEX`` (a dash) for config and layers. Keys are
    ``HOST/NAMESPACE/MODEL/TAG`` (``registry.ollama.ai/library/llama3.2/1b``). Returns ``folder``."""
    folder = Path(folder)
    for name, artifact in models.items():
        parts = name.split("/")
        if len(parts) != 4 or not all(parts):
            raise ValueError(f"{name}: an Ollama model is HOST/NAMESPACE/MODEL/TAG")
        _write(folder / "manifests" / Path(*parts), artifact.manifest_bytes())
        for digest, data in artifact.blobs.items():
            _write(folder / "blobs" / digest.replace(":", "-"), data)
    return folder


# --- the registry -----------------------------------------------------------------------------------------


HTTP_TIMEOUT = 10.0  # seconds a push helper's request may take (a benchmark pushing a GiB gives more)


def _http(
    url: str,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    timeout: float | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One request on its own connection: (status, headers with lower-case names, body)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or LOCALHOST, parts.port, timeout=timeout or HTTP_TIMEOUT)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection.request(method, target, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


class Registry:
    """``docker-registry serve CONFIG`` on 127.0.0.1 and a free port, storage in ``workdir/storage``; token auth
    when given a ``TokenIssuer`` (started first: its certificate goes in the config)."""

    SERVICE = "stfs-test-registry"

    def __init__(
        self,
        workdir: Path,
        auth: TokenIssuer | None = None,
        executable: str | None = None,
        htpasswd: dict[str, str] | None = None,
        storage: Path | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.auth = auth
        self.htpasswd = htpasswd  # user -> password: HTTP Basic auth (bcrypt hashes in an htpasswd file)
        self._storage = storage  # another registry's storage, served by this one too
        self.executable = executable or find_tool("docker-registry") or "docker-registry"
        self.port = 0
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._repos = 0

    @property
    def host(self) -> str:
        return f"{LOCALHOST}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    @property
    def storage(self) -> Path:
        return self._storage or self.workdir / "storage"

    @property
    def log_path(self) -> Path:
        return self.workdir / "registry.log"

    def blob_path(self, digest: str) -> Path:
        """Where the filesystem driver keeps a blob's bytes."""
        algorithm, hexdigest = digest.split(":", 1)
        return self.storage / "docker/registry/v2/blobs" / algorithm / hexdigest[:2] / hexdigest / "data"

    def start(self) -> Registry:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.storage.mkdir(exist_ok=True)
        # REGISTRY_* variables override the config file: none from the machine.
        env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
        for attempt in range(3):
            self.port = free_port()
            config = self.workdir / "config.yml"
            config.write_text(self._config())
            with open(self.log_path, "wb") as output:
                self._process = subprocess.Popen(
                    [self.executable, "serve", str(config)],
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            try:
                wait_until(self._serving, START_TIMEOUT, "docker-registry", step=0.05)
                return self
            except (TimeoutError, RuntimeError):
                text = self.log_path.read_text(errors="replace")
                self.stop()
                if "address already in use" not in text or attempt == 2:
                    raise RuntimeError(f"docker-registry did not start: {text[-2000:]}") from None
        return self

    def stop(self) -> None:
        if self._process is not None:
            _stop_process(self._process)
            self._process = None

    def repo(self, hint: str = "model") -> str:
        """A repository name no other test uses (distribution's grammar: lower case, digits, ``._-``, ``/``)."""
        with self._lock:
            self._repos += 1
            number = self._repos
        clean = re.sub(r"[^a-z0-9]+", "-", hint.lower()).strip("-")[:40] or "model"
        return f"stfs/{clean}-{number}-{secrets.token_hex(3)}"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def _serving(self) -> bool:
        if self._process is None or self._process.poll() is not None:
            raise RuntimeError("docker-registry exited")
        try:
            status, _, _ = _http(f"{self.url}/v2/", timeout=1.0)
        except OSError:
            return False
        return status in (200, 401)

    def _config(self) -> str:
        # JSON is YAML: no quoting rules to get wrong. No http.debug: distribution then opens no second port.
        config: dict[str, Any] = {
            "version": "0.1",
            "log": {"level": "info", "formatter": "text", "accesslog": {"disabled": False}},
            "storage": {
                "filesystem": {"rootdirectory": str(self.storage)},
                "delete": {"enabled": True},
                "maintenance": {"uploadpurging": {"enabled": False}},
            },
            "http": {"addr": f"{LOCALHOST}:{self.port}", "secret": secrets.token_hex(16)},
            "health": {"storagedriver": {"enabled": False}},
        }
        if self.htpasswd is not None:
            import bcrypt

            path = self.workdir / "htpasswd"
            lines = [
                f"{user}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()}"
                for user, password in self.htpasswd.items()
            ]
            path.write_text("\n".join(lines) + "\n")
            config["auth"] = {"htpasswd": {"realm": "stfs-basic", "path": str(path)}}
        if self.auth is not None:
            config["auth"] = {
                "token": {
                    "realm": self.auth.realm,
                    "service": self.SERVICE,
                    "issuer": self.auth.issuer,
                    "rootcertbundle": str(self.auth.certificate_path),
                }
            }
        return json.dumps(config, indent=2) + "\n"


# --- the token issuer -------------------------------------------------------------------------------------


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def decode_jwt(token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(header, claims) of a JWT, unverified: for tests to look inside a token."""
    header, claims, _ = token.split(".")

    def part(text: str) -> dict[str, Any]:
        return json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))

    return part(header), part(claims)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hangs up mid-answer is not a test failure


class TokenIssuer:
    """The Docker token flow's auth server: ``GET /token?service=…&scope=repository:NAME:pull[,push]`` with
    optional Basic credentials -> ``{"token", "access_token", "expires_in", "issued_at"}``.

    A known user with the right password gets pull and push on every repository; anonymous gets pull on the
    ``public`` repositories and nothing elsewhere (the registry then answers 401 ``insufficient_scope``); a wrong
    password gets 401 here. Tokens are ES256 JWTs signed by a self-signed certificate's key, sent in ``x5c``.

    distribution 2.8.2 accepts a token up to 60 s past its ``exp`` (its ``Leeway``): the ``exp`` claim is written
    ``leeway`` seconds early so that the registry refuses a token ``expires_in`` seconds after it was issued, as a
    client reading ``expires_in`` expects.
    """

    ISSUER = "stfs-test-issuer"

    def __init__(
        self,
        workdir: Path,
        users: dict[str, str] | None = None,
        public: tuple[str, ...] | list[str] = (),
        expires_in: int = 300,
        leeway: int = 60,
    ) -> None:
        self.workdir = Path(workdir)
        self.users = dict(users or {})
        self.public = set(public)
        self.expires_in = expires_in
        self.leeway = leeway
        self.issuer = self.ISSUER
        self.issued: list[tuple[str | None, str]] = []  # (user or None, scope) of each token issued
        self.requests: list[dict[str, str]] = []  # each request: user, scope, service, status (never a password)
        self._lock = threading.Lock()
        self._server: _QuietServer | None = None
        self._thread: threading.Thread | None = None
        self._key: Any = None
        self._x5c = ""

    @property
    def port(self) -> int:
        assert self._server is not None, "the token issuer is not running"
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"

    @property
    def realm(self) -> str:
        return f"{self.url}/token"

    @property
    def certificate_path(self) -> Path:
        return self.workdir / "token-signer.pem"

    @property
    def tokens_issued(self) -> int:
        with self._lock:
            return len(self.issued)

    def start(self) -> TokenIssuer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._make_certificate()
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                status, body, headers = issuer._answer(self.path, self.headers.get("Authorization"))
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = _QuietServer((LOCALHOST, 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="token-issuer")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(STOP_TIMEOUT)
            self._server = None

    def clear(self) -> None:
        with self._lock:
            self.issued.clear()
            self.requests.clear()

    def token(self, scope: str, user: str | None = None, expires_in: int | None = None) -> str:
        """A token as the endpoint would issue it to ``user`` (checked as there: no password needed here)."""
        return self._sign(user, self._grant(user, scope), expires_in or self.expires_in)

    def _make_certificate(self) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        now = datetime.datetime.now(datetime.timezone.utc)
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stfs test token signer")])
        # No extended key usage: distribution verifies the chain for ExtKeyUsageAny.
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.certificate_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        self._x5c = base64.b64encode(certificate.public_bytes(serialization.Encoding.DER)).decode()

    def _grant(self, user: str | None, scope: str) -> list[dict[str, Any]]:
        access = []
        for item in scope.split(" "):
            parts = item.split(":")
            if len(parts) < 3 or parts[0] != "repository":
                continue
            name, wanted = ":".join(parts[1:-1]), parts[-1].split(",")
            allowed = {"pull", "push"} if user is not None else ({"pull"} if name in self.public else set())
            actions = [action for action in wanted if action in allowed]
            access.append({"type": "repository", "name": name, "actions": actions})
        return access

    def _sign(self, user: str | None, access: list[dict[str, Any]], expires_in: int) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

        now = int(time.time())
        header = {"typ": "JWT", "alg": "ES256", "x5c": [self._x5c]}
        claims = {
            "iss": self.issuer,
            "sub": user or "",
            "aud": Registry.SERVICE,
            "exp": now + expires_in - self.leeway,
            "nbf": now - 1,
            "iat": now,
            "jti": uuid.uuid4().hex,
            "access": access,
        }
        signing_input = f"{_b64url(go_json(header))}.{_b64url(go_json(claims))}"
        r, s = decode_dss_signature(self._key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
        return f"{signing_input}.{_b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"

    def _answer(self, path: str, authorization: str | None) -> tuple[int, bytes, dict[str, str]]:
        parts = urlsplit(path)
        query = parse_qs(parts.query)
        scope = " ".join(query.get("scope", []))
        service = (query.get("service") or [""])[0]
        user: str | None = None
        denied = False
        if authorization and authorization.lower().startswith("basic "):
            try:
                user, _, password = base64.b64decode(authorization[6:].strip()).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                user, password = "", ""
            known = self.users.get(user)
            denied = known is None or not hmac.compare_digest(known, password)
        if parts.path != "/token":
            status, body, headers = 404, b'{"errors":[{"code":"NOT_FOUND"}]}', {}
        elif denied:
            status, body = 401, b'{"details":"incorrect username or password"}'
            headers = {"WWW-Authenticate": 'Basic realm="stfs test token issuer"'}
        else:
            token = self._sign(user, self._grant(user, scope), self.expires_in)
            issued_at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            body = go_json(
                {"token": token, "access_token": token, "expires_in": self.expires_in, "issued_at": issued_at}
            )
            status, headers = 200, {}
            with self._lock:
                self.issued.append((user, scope))
        with self._lock:
            self.requests.append({"user": user or "", "scope": scope, "service": service, "status": str(status)})
        return status, body, headers


# --- the blob redirector and its CDN ----------------------------------------------------------------------

_BLOB_PATH = re.compile(r"^/v2/(?P<name>.+)/blobs/sha256:(?P<hex>[0-9a-f]{64})$")
_CDN_PATH = re.compile(r"^/cdn/sha256/(?P<hex>[0-9a-f]{64})$")
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
}


@dataclass(frozen=True, slots=True)
class CdnRequest:
    """One request the CDN answered: its headers (lower-case names) and what went back."""

    method: str
    path: str  # with its query
    headers: dict[str, str]
    status: int
    content_range: str
    body: bytes


def _parse_range(header: str, size: int) -> tuple[int, int] | None | str:
    """A single ``bytes=`` range as (first, last) inclusive; None to send the whole; "unsatisfiable" for 416."""
    match = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header)
    if match is None:
        return None  # several ranges or another unit: the whole body, as RFC 9110 allows
    first_text, last_text = match.groups()
    if not first_text:
        if not last_text:
            return None
        length = int(last_text)
        if length == 0 or size == 0:
            return "unsatisfiable"
        return max(0, size - length), size - 1
    first = int(first_text)
    last = int(last_text) if last_text else size - 1
    if first >= size or (last_text and last < first):
        return "unsatisfiable"
    return first, min(last, size - 1)


class BlobRedirector:
    """A reverse proxy at ``url`` in front of a ``Registry`` that forwards every request as is, except
    ``GET``/``HEAD /v2/NAME/blobs/sha256:HEX``: it asks the registry (``HEAD`` of that blob with the client's
    headers) whether the client may read it and passes a 401 (with its ``WWW-Authenticate``) or 404 on; else it
    answers ``307 Location: http://localhost:CDNPORT/cdn/sha256/HEX?sig=…``. Another host name than 127.0.0.1:
    the client must drop ``Authorization`` when it follows.

    The CDN serves blob bytes from the registry's storage with ``Range`` (206, ``Content-Range``, 416), refuses a
    wrong ``sig`` with 403, and records each request (``cdn_requests``).
    """

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.secret = secrets.token_hex(16)
        self.redirects = 0
        self._requests: list[CdnRequest] = []
        self._proxied: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._proxy: _QuietServer | None = None
        self._cdn: _QuietServer | None = None
        self._threads: list[threading.Thread] = []

    @property
    def port(self) -> int:
        assert self._proxy is not None, "the redirector is not running"
        return int(self._proxy.server_address[1])

    @property
    def cdn_port(self) -> int:
        assert self._cdn is not None, "the redirector is not running"
        return int(self._cdn.server_address[1])

    @property
    def host(self) -> str:
        return f"{LOCALHOST}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    @property
    def cdn_url(self) -> str:
        return f"http://localhost:{self.cdn_port}"

    def signature(self, hexdigest: str) -> str:
        return hmac.new(self.secret.encode(), hexdigest.encode(), hashlib.sha256).hexdigest()

    def cdn_requests(self) -> list[CdnRequest]:
        with self._lock:
            return list(self._requests)

    def proxied(self) -> list[tuple[str, str]]:
        """(method, path) of each request the proxy received."""
        with self._lock:
            return list(self._proxied)

    def clear(self) -> None:
        with self._lock:
            self._requests.clear()
            self._proxied.clear()
            self.redirects = 0

    def start(self) -> BlobRedirector:
        owner = self

        class ProxyHandler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                owner._proxy_request(self)

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _handle  # noqa: N815

        class CdnHandler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                owner._cdn_request(self)

            do_GET = do_HEAD = _handle  # noqa: N815

        self._proxy = _QuietServer((LOCALHOST, 0), ProxyHandler)
        self._cdn = _QuietServer((LOCALHOST, 0), CdnHandler)
        for server, name in ((self._proxy, "blob-redirector"), (self._cdn, "blob-cdn")):
            thread = threading.Thread(target=server.serve_forever, daemon=True, name=name)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        for server in (self._proxy, self._cdn):
            if server is not None:
                server.shutdown()
                server.server_close()
        for thread in self._threads:
            thread.join(STOP_TIMEOUT)
        self._proxy = self._cdn = None
        self._threads = []

    def _forward_headers(self, handler: BaseHTTPRequestHandler) -> dict[str, str]:
        return {k: v for k, v in handler.headers.items() if k.lower() not in _HOP_BY_HOP}

    def _send(
        self, handler: BaseHTTPRequestHandler, status: int, headers: list[tuple[str, str]], body: bytes, head: bool
    ) -> None:
        handler.send_response(status)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(body)) if not head else self._length(headers, body))
        handler.end_headers()
        if not head:
            handler.wfile.write(body)

    @staticmethod
    def _length(headers: list[tuple[str, str]], body: bytes) -> str:
        for name, value in headers:
            if name.lower() == "content-length":
                return value
        return str(len(body))

    def _proxy_request(self, handler: BaseHTTPRequestHandler) -> None:
        method, path = handler.command, handler.path
        with self._lock:
            self._proxied.append((method, path))
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else None
        headers = self._forward_headers(handler)
        head = method == "HEAD"
        blob = _BLOB_PATH.match(urlsplit(path).path)
        connection = http.client.HTTPConnection(LOCALHOST, self.registry.port, timeout=30)
        try:
            if blob is not None and method in ("GET", "HEAD"):
                headers.pop("Range", None)
                headers.pop("range", None)
                connection.request("HEAD", urlsplit(path).path, headers=headers)
                answer = connection.getresponse()
                answer.read()
                if answer.status != 200:
                    if not head:  # the refusal's body (the registry's JSON errors) comes with a GET only
                        connection.request("GET", urlsplit(path).path, headers=headers)
                        answer = connection.getresponse()
                    self._send(handler, answer.status, answer.getheaders(), answer.read(), head=head)
                    return
                hexdigest = blob.group("hex")
                location = f"{self.cdn_url}/cdn/sha256/{hexdigest}?{urlencode({'sig': self.signature(hexdigest)})}"
                with self._lock:
                    self.redirects += 1
                redirect = [("Location", location), ("Docker-Content-Digest", f"sha256:{hexdigest}")]
                self._send(handler, 307, redirect, b"", head=head)
                return
            connection.request(method, path, body=body, headers=headers)
            answer = connection.getresponse()
            data = answer.read()
            self._send(handler, answer.status, answer.getheaders(), data, head=head)
        except OSError:
            handler.close_connection = True
            with contextlib.suppress(OSError):
                self._send(handler, 502, [("Content-Type", "text/plain")], b"registry unreachable\n", head=head)
        finally:
            connection.close()

    def _cdn_request(self, handler: BaseHTTPRequestHandler) -> None:
        method, path = handler.command, handler.path
        head = method == "HEAD"
        headers = {k.lower(): v for k, v in handler.headers.items()}
        parts = urlsplit(path)
        match = _CDN_PATH.match(parts.path)
        status, body, content_range = 200, b"", ""
        out: list[tuple[str, str]] = [("Accept-Ranges", "bytes")]
        sig = (parse_qs(parts.query).get("sig") or [""])[0]
        blob = None if match is None else self.registry.blob_path("sha256:" + match.group("hex"))
        if match is None or blob is None or not blob.is_file():
            status, body = 404, b"no such blob\n"
        elif not hmac.compare_digest(sig, self.signature(match.group("hex"))):
            status, body = 403, b"bad signature\n"
        else:
            data = blob.read_bytes()
            out += [("Content-Type", "application/octet-stream"), ("ETag", f'"sha256:{match.group("hex")}"')]
            wanted = _parse_range(headers.get("range", ""), len(data)) if "range" in headers else None
            if wanted == "unsatisfiable":
                status, content_range = 416, f"bytes */{len(data)}"
            elif isinstance(wanted, tuple):
                first, last = wanted
                status, body = 206, data[first : last + 1]
                content_range = f"bytes {first}-{last}/{len(data)}"
            else:
                body = data
        if content_range:
            out.append(("Content-Range", content_range))
        with self._lock:
            self._requests.append(CdnRequest(method, path, headers, status, content_range, b"" if head else body))
        handler.send_response(status)
        for name, value in out:
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if not head:
            handler.wfile.write(body)


# --- pushing ----------------------------------------------------------------------------------------------


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    """(scheme, parameters) of a ``WWW-Authenticate`` header."""
    scheme, _, rest = header.strip().partition(" ")
    return scheme.lower(), {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', rest)}


class RegistryClient:
    """Plain HTTP calls to a registry, answering Bearer and Basic challenges with ``credentials`` (user, password).
    Enough to push and read back in tests; not the client under test."""

    def __init__(self, base_url: str, credentials: tuple[str, str] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.credentials = credentials
        self._authorization: dict[str, str] = {}  # repository -> Authorization header

    def request(
        self,
        method: str,
        path_or_url: str,
        repo: str,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
        actions: str = "pull,push",
    ) -> tuple[int, dict[str, str], bytes]:
        url = path_or_url if "://" in path_or_url else self.base_url + path_or_url
        for _ in range(2):
            sent = dict(headers or {})
            if repo in self._authorization:
                sent["Authorization"] = self._authorization[repo]
            status, answer, data = _http(url, method, sent, body)
            if status != 401 or "www-authenticate" not in answer:
                return status, answer, data
            if not self._authorize(repo, answer["www-authenticate"], actions):
                return status, answer, data
        return status, answer, data

    def _authorize(self, repo: str, header: str, actions: str) -> bool:
        scheme, params = _challenge(header)
        basic = None
        if self.credentials is not None:
            basic = "Basic " + base64.b64encode(":".join(self.credentials).encode()).decode()
        if scheme == "basic":
            if basic is None:
                return False
            self._authorization[repo] = basic
            return True
        if scheme != "bearer" or "realm" not in params:
            return False
        query = {"service": params.get("service", ""), "scope": f"repository:{repo}:{actions}"}
        status, _, data = _http(
            f"{params['realm']}?{urlencode(query)}", headers={"Authorization": basic} if basic else {}
        )
        if status != 200:
            raise PermissionError(f"token endpoint answered {status}")
        answer = json.loads(data)
        self._authorization[repo] = "Bearer " + (answer.get("token") or answer["access_token"])
        return True

    def push_blob(self, repo: str, digest: str, data: bytes) -> bool:
        """Upload a blob in one PUT unless the repository has it: whether it was uploaded."""
        status, _, _ = self.request("HEAD", f"/v2/{repo}/blobs/{digest}", repo)
        if status == 200:
            return False
        status, headers, body = self.request("POST", f"/v2/{repo}/blobs/uploads/", repo, body=b"")
        if status != 202:
            raise RuntimeError(f"blob upload to {repo} refused: {status} {body[:300]!r}")
        location = headers["location"]
        if "://" not in location:
            location = self.base_url + location
        joiner = "&" if "?" in location else "?"
        put_headers = {"Content-Type": "application/octet-stream"}
        status, _, body = self.request(
            "PUT", f"{location}{joiner}{urlencode({'digest': digest})}", repo, put_headers, data
        )
        if status != 201:
            raise RuntimeError(f"blob {digest} to {repo}: {status} {body[:300]!r}")
        return True

    def put_manifest(self, repo: str, ref: str, artifact: Artifact) -> str:
        headers = {"Content-Type": artifact.media_type}
        status, answer, body = self.request(
            "PUT", f"/v2/{repo}/manifests/{ref}", repo, headers, artifact.manifest_bytes()
        )
        if status != 201:
            raise RuntimeError(f"manifest {repo}:{ref} refused: {status} {body[:500]!r}")
        return answer.get("docker-content-digest", artifact.digest)

    def get_manifest(self, repo: str, ref: str, accept: str = MANIFEST_ACCEPT) -> tuple[int, dict[str, str], bytes]:
        return self.request("GET", f"/v2/{repo}/manifests/{ref}", repo, {"Accept": accept}, actions="pull")


def _base_url(registry: Registry | BlobRedirector | str) -> str:
    return registry if isinstance(registry, str) else registry.url


def push(
    registry: Registry | BlobRedirector | str,
    repo: str,
    ref: str,
    artifact: Artifact,
    credentials: tuple[str, str] | None = None,
) -> str:
    """Push ``artifact`` (its blobs monolithically, skipping those the registry has, then its manifest with its
    media type as Content-Type) to ``repo`` as ``ref`` (a tag or a digest); an index's manifests first. Returns the
    manifest digest the registry answered."""
    client = RegistryClient(_base_url(registry), credentials)
    return _push(client, repo, ref, artifact)


def _push(client: RegistryClient, repo: str, ref: str, artifact: Artifact) -> str:
    for child in artifact.children:
        _push(client, repo, child.digest, child)
    for digest, data in artifact.blobs.items():
        client.push_blob(repo, digest, data)
    digest = client.put_manifest(repo, ref, artifact)
    if digest != artifact.digest:
        raise RuntimeError(f"the registry named {repo}:{ref} {digest}, its bytes hash to {artifact.digest}")
    return digest


def push_index(
    registry: Registry | BlobRedirector | str,
    repo: str,
    ref: str,
    entries: list[tuple[Artifact, dict[str, Any]]],
    credentials: tuple[str, str] | None = None,
) -> tuple[Artifact, str]:
    """Build an index of ``entries`` (see ``index``), push each manifest by digest and the index as ``ref``:
    (the index, its digest)."""
    built = index(entries)
    return built, push(registry, repo, ref, built, credentials)


def auth_config(host: str, user: str, password: str) -> dict[str, Any]:
    """A docker ``config.json`` with an ``auths`` entry for HOST."""
    return {"auths": {host: {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}}}


def write_registry_auth_file(folder: Path, host: str, user: str, password: str) -> Path:
    """``FOLDER/config.json`` as ``docker login HOST`` writes it (``REGISTRY_AUTH_FILE`` points at it), mode 0600."""
    path = Path(folder) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(auth_config(host, user, password), indent="\t"))
    path.chmod(0o600)
    return path
