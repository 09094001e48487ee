"""Models in OCI artifacts (SPEC §14): a registry's (``oci://``), an OCI image layout folder's, Ollama's models
folder's.

Each is shown as the folder of files its layers make (``oci_artifact`` names them, ``tar_index`` unpacks an
uncompressed tar in place), a ``MappedFiles`` over the blobs: a ``RemoteFiles`` of the registry (``OciTransport``:
nothing is pulled, every byte a ranged GET of a blob, through the block cache, readahead, retries and the disk
cache as any remote file) or ``LocalFiles`` of the store's blobs folder. Discovery then finds the model(s) there as
in any folder (§1). A mount is pinned to the manifest's digest; blobs are content addressed.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from datetime import datetime
from typing import Any

from .. import errors
from .base import DEFAULT_CACHE_SIZE, DEFAULT_TIMEOUT, ByteSource, Kind, join_key
from .mapped import Group, MappedFiles, Piece
from .oci_artifact import (
    ACCEPT,
    INDEX_TYPES,
    REF_NAME,
    Artifact,
    check_digest,
    choose_manifest,
    media_type_of,
    member_path,
    parse_json,
    read_manifest,
)
from .registry import BlobClient, Registry, parse_reference
from .remote import RemoteFiles
from .tar_index import TarIndexError, members
from .transport import Listing, Transport

log = logging.getLogger(__name__)

OLLAMA_HOST = "registry.ollama.ai"
MAX_INDEX_DEPTH = 4  # an index naming an index …: followed this deep


class OciTransport(Transport):
    """The blobs of one repository of a registry, read by range through ``BlobClient``; keys ``BASE/blobs/DIGEST``.
    Every blob's size comes with the manifest, so none is asked for before it is read."""

    def __init__(self, registry: Registry, sizes: dict[str, int], mtime_ns: int, timeout: float) -> None:
        reference = registry.reference
        self.registry = registry
        self.base = f"oci://{reference.host}/{reference.repository}"
        self.sizes = sizes
        self.mtime_ns = mtime_ns
        self.timeout = timeout
        self._client: BlobClient | None = None

    def blob_key(self, digest: str) -> str:
        return f"{self.base}/blobs/{digest}"

    def make_store(self) -> Any:
        return None  # every request goes through the client: obstore knows no registry tokens

    def client(self) -> BlobClient:  # type: ignore[override]
        if self._client is None:
            self._client = BlobClient(self.registry, self.timeout)
        return self._client

    def read_range(self, key: str, lo: int, hi: int) -> memoryview | None:
        into = memoryview(bytearray(hi - lo))
        self.client().get_into(self.path(key), lo, into)
        return into

    def describe(self, key: str) -> Listing | None:
        digest = key.rsplit("/", 1)[-1]
        size = self.sizes.get(digest)
        return Listing(Kind.FILE, size, None, digest, self.mtime_ns) if size is not None else Listing(None)

    def still_there(self, store: Any, key: str, etag: str | None, version: str | None, size: int) -> bool:
        if not self.registry.blob_exists(key.rsplit("/", 1)[-1]):
            raise FileNotFoundError(key)
        return True  # a blob is its digest: if it is there, it is the same

    def lookups(self) -> int:
        return self.registry.requests

    def prepare(self) -> None:
        """Nothing: the registry's TLS context was made when the manifest was fetched."""


def open_registry(
    text: str,
    *,
    plain_http: bool = False,
    cache_size: int = DEFAULT_CACHE_SIZE,
    timeout: float = DEFAULT_TIMEOUT,
    ranges_required: bool = False,
    disk: Any = None,
) -> tuple[MappedFiles, str]:
    """The artifact ``oci://…`` names, pinned to its manifest's digest, as a folder of files; and its key."""
    reference = parse_reference(text, plain_http)
    registry = Registry(reference, timeout)
    shown = reference.shown
    artifact = follow_to_manifest(
        lambda name: registry.manifest(name, ACCEPT), reference.digest or reference.tag or "latest", shown
    )
    sizes = {layer.digest: layer.size for layer in artifact.layers}
    transport = OciTransport(registry, sizes, _mtime_ns(artifact.created), timeout)
    remote = RemoteFiles(
        transport,
        cache_size=cache_size,
        timeout=timeout,
        disk_cache=disk,
        ranges_required=ranges_required,
        prefault=ranges_required,
    )
    root = reference.pinned(artifact.digest)
    try:
        files = artifact_files(artifact, root, transport.blob_key, remote.read, shown)
    except BaseException:
        remote.close()
        raise
    metadata = {"oci.digest": artifact.digest, "oci.reference": shown, **artifact.annotations}
    return MappedFiles(remote, files, [_group(artifact, root, metadata, transport.blob_key)]), root


def _group(artifact: Artifact, root: str, metadata: dict[str, str], blob_key: Callable[[str], str]) -> Group:
    blobs = tuple(dict.fromkeys((blob_key(layer.digest), layer.digest, layer.size) for layer in artifact.layers))
    return Group(root, metadata, artifact.warnings, blobs)


def follow_to_manifest(fetch: Callable[[str], tuple[bytes, str | None]], reference: str, where: str) -> Artifact:
    """The manifest ``reference`` (a tag or a digest) names, read; ``fetch(reference)`` gives a manifest's or an
    index's bytes and the media type its store says. An index is followed to the manifest it stands for; bytes
    fetched by digest must have that digest."""
    for _ in range(MAX_INDEX_DEPTH):
        body, told = fetch(reference)
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if reference.startswith("sha256:") and digest != reference:
            raise errors.SourceError(f"{where}: the manifest {reference} holds other bytes (their digest is {digest})")
        document = parse_json(body, where)
        media_type = media_type_of(document, told)
        if media_type in INDEX_TYPES:
            reference = choose_manifest(document, where)
            continue
        return read_manifest(document, digest, media_type, where)
    raise errors.SourceError(f"{where}: image indexes nested more than {MAX_INDEX_DEPTH} deep")


def artifact_files(
    artifact: Artifact,
    root: str,
    blob_key: Callable[[str], str],
    read: Callable[[str, int, int], bytes],
    where: str,
) -> dict[str, Piece]:
    """The files of ``artifact`` as keys below ``root``: each layer a file, an unpacked tar's members each one (its
    headers read through ``read(blob key, offset, size)``); a ``SourceError`` where two take one path."""
    files: dict[str, Piece] = {}
    origin: dict[str, str] = {}
    for layer in artifact.layers:
        key = blob_key(layer.digest)
        if not layer.unpack:
            placed = [(layer.name, Piece(key, 0, layer.size, whole=True, sha256=layer.digest.partition(":")[2]))]
        else:
            try:
                found = members(lambda offset, size, key=key: read(key, offset, size), layer.size)  # type: ignore[misc]
            except TarIndexError as exc:
                raise errors.SourceError(f"{where}: layer {layer.digest} is not a tar stfs can read ({exc})") from None
            except OSError as exc:
                raise errors.SourceError(f"{where}: layer {layer.digest}: cannot read: {exc}") from None
            placed = []
            for member in found:
                path = member_path(layer, member.path)
                if path is None:
                    log.warning("%s: layer %s: member %r is outside the model: left out", where, layer.digest, member)
                    continue
                placed.append((path, Piece(key, member.offset, member.size)))
        for path, piece in placed:
            if path in origin:
                raise errors.SourceError(f"{where}: {path!r} is in both layer {origin[path]} and layer {layer.digest}")
            origin[path] = layer.digest
            files[join_key(root, path)] = piece
    folders = {key.rsplit("/", 1)[0] for key in files}
    for key in files:
        if key in folders:
            raise errors.SourceError(f"{where}: {key[len(root) + 1 :]!r} is both a file and a folder of the artifact")
    return files


def _mtime_ns(created: str | None) -> int:
    if not created:
        return 0
    try:
        return int(datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp() * 1e9)
    except ValueError:
        return 0


# -- local stores of the same shape ---------------------------------------------------------------------------------


def open_local_store(path: str, local: ByteSource) -> tuple[MappedFiles, str] | None:
    """An OCI image layout folder, an Ollama models folder (or its ``manifests/``), or one of its manifest files, as
    the folder of files its artifacts make (blobs read in place from ``local``); ``None`` for any other path."""
    path = os.path.abspath(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "oci-layout")):
        return _oci_layout(path, local)
    ollama = _ollama_root(path)
    if ollama is None:
        return None
    if os.path.isfile(path):
        return _ollama(ollama, local, [path], single=True)
    manifests = _walk_files(os.path.join(ollama, "manifests"))
    if not manifests:
        raise errors.SourceError(f"{path}: an Ollama models folder with no manifest in manifests/")
    return _ollama(ollama, local, manifests, single=False)


def _oci_layout(folder: str, local: ByteSource) -> tuple[MappedFiles, str]:
    index_path = os.path.join(folder, "index.json")
    document = parse_json(_read_file(index_path), index_path)
    entries = [entry for entry in document.get("manifests") or [] if isinstance(entry, dict)]
    if not entries:
        raise errors.SourceError(f"{index_path}: the OCI layout lists no manifest")

    def blob(digest: str) -> str:
        return os.path.join(folder, "blobs", "sha256", digest.partition(":")[2])

    groups: list[Group] = []
    files: dict[str, Piece] = {}
    named: dict[str, str] = {}
    for entry in entries:
        digest = check_digest(entry.get("digest"), index_path)
        ref = str((entry.get("annotations") or {}).get(REF_NAME) or "") or f"sha256-{digest[7:19]}"
        where = f"{folder} ({ref})"
        artifact = follow_to_manifest(lambda name: (_read_file(blob(name)), None), digest, where)
        name = _safe_name(ref, where)
        if name in named:
            raise errors.SourceError(f"{index_path}: two manifests are named {name!r}")
        named[name] = digest
        root = folder if len(entries) == 1 else join_key(folder, name)
        files.update(artifact_files(artifact, root, blob, local.read, where))
        metadata = {"oci.digest": artifact.digest, "oci.reference": ref, **artifact.annotations}
        groups.append(_group(artifact, root, metadata, blob))
    return MappedFiles(local, files, groups), folder


def _ollama_root(path: str) -> str | None:
    """The models folder (holding ``manifests/`` and ``blobs/``) that ``path`` is, or whose ``manifests/`` it is or
    lies in; else ``None``."""
    here = path
    while True:
        if os.path.isdir(os.path.join(here, "manifests")) and os.path.isdir(os.path.join(here, "blobs")):
            inside = os.path.relpath(path, here)
            if inside == "." or inside == "manifests" or inside.startswith("manifests" + os.sep):
                return here
            if inside == "blobs":  # its files have no names to find models by: the manifests give them
                raise errors.SourceError(
                    f"{path}: the blobs of an Ollama models folder; mount {here} (every model by name), a manifest "
                    "of it, or one blob file"
                )
            return None
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def _ollama(folder: str, local: ByteSource, manifests: list[str], single: bool) -> tuple[MappedFiles, str]:
    """The models of ``manifests`` (files below ``folder``'s ``manifests/``), each in a folder ``NAMESPACE/MODEL:TAG``
    below ``folder``; ``single``: the one manifest SOURCE named, its model at its own path."""

    def blob(digest: str) -> str:
        return os.path.join(folder, "blobs", "sha256-" + digest.partition(":")[2])

    groups: list[Group] = []
    files: dict[str, Piece] = {}
    for manifest in manifests:
        parts = os.path.relpath(manifest, os.path.join(folder, "manifests")).split(os.sep)
        if len(parts) != 4:
            raise errors.SourceError(f"{manifest}: not manifests/HOST/NAMESPACE/MODEL/TAG of an Ollama models folder")
        host, namespace, model, tag = parts
        name = f"{namespace}/{model}:{tag}" if host == OLLAMA_HOST else f"{host}/{namespace}/{model}:{tag}"
        body = _read_file(manifest)
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        document = parse_json(body, manifest)
        artifact = read_manifest(document, digest, media_type_of(document, None), manifest)
        root = manifest if single else join_key(folder, name)
        files.update(artifact_files(artifact, root, blob, local.read, manifest))
        metadata = {"oci.digest": digest, "oci.reference": name, **artifact.annotations}
        groups.append(_group(artifact, root, metadata, blob))
    return MappedFiles(local, files, groups, named_models=not single), manifests[0] if single else folder


def _read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as stream:
            return stream.read(4 << 20)
    except OSError as exc:
        raise errors.SourceError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _walk_files(folder: str) -> list[str]:
    found = []
    for parent, subfolders, names in os.walk(folder):
        subfolders.sort()
        found += [os.path.join(parent, name) for name in sorted(names)]
    return found


def _safe_name(ref: str, where: str) -> str:
    """A ref name as a folder of the mount: its ``/`` kept as folders, no empty, ``.`` or ``..`` component."""
    parts = ref.split("/")
    if any(part in ("", ".", "..") or "\0" in part for part in parts):
        raise errors.SourceError(f"{where}: the ref name {ref!r} is not a folder name stfs can show")
    return "/".join(parts)
