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
from .disk_cache import DiskCache, open_disk_cache
from .layers import Unpacker
from .mapped import Group, MappedFiles, Piece
from .oci_artifact import (
    ACCEPT,
    INDEX_TYPES,
    REF_NAME,
    Artifact,
    check_digest,
    choose_manifest,
    media_type_of,
    parse_json,
    read_manifest,
)
from .registry import BlobClient, Registry, parse_reference
from .remote import RemoteFiles
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
    disk: DiskCache | None = None,
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
    unpacker = Unpacker(remote, transport.blob_key, disk)
    try:
        files = unpacker.files(artifact, root, shown)
    except BaseException:
        unpacker.close()
        remote.close()
        raise
    metadata = {"oci.digest": artifact.digest, "oci.reference": shown, **artifact.annotations}
    group = _group(artifact, root, metadata, transport.blob_key, unpacker.warnings, unpacker.model_folders.get(root))
    return MappedFiles(remote, files, [group], decoded=unpacker.decoded), root


def _group(
    artifact: Artifact,
    root: str,
    metadata: dict[str, str],
    blob_key: Callable[[str], str],
    more: list[str],
    model_folder: str | None = None,
) -> Group:
    blobs = tuple(dict.fromkeys((blob_key(layer.digest), layer.digest, layer.size) for layer in artifact.layers))
    return Group(root, metadata, (*artifact.warnings, *more), blobs, model_folder)


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


def _mtime_ns(created: str | None) -> int:
    if not created:
        return 0
    try:
        return int(datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp() * 1e9)
    except ValueError:
        return 0


# -- local stores of the same shape ---------------------------------------------------------------------------------


def open_local_store(
    path: str,
    local: ByteSource,
    ref: str | None = None,
    cache_dir: str | None = None,
    cache_dir_size: int | None = None,
) -> tuple[MappedFiles, str] | None:
    """An OCI image layout folder (``ref``: only its manifest of that ``org.opencontainers.image.ref.name``), an
    Ollama models folder (or its ``manifests/``), or one of its manifest files, as the folder of files its artifacts
    make (blobs read in place from ``local``; what compressed layers' passes find kept in ``cache_dir``, within
    ``cache_dir_size``); ``None`` for any other path. In a store of several models, one that cannot be read is left
    out with a warning."""
    path = os.path.abspath(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "oci-layout")):
        return _oci_layout(path, local, ref, open_disk_cache(cache_dir, cache_dir_size))
    if ref is not None:
        raise errors.SourceError(f"{path}:{ref}: {path} is not an OCI image layout folder (no oci-layout file)")
    ollama = _ollama_root(path)
    if ollama is None:
        return None
    disk = open_disk_cache(cache_dir, cache_dir_size)
    if os.path.isfile(path):
        return _ollama(ollama, local, [path], True, disk)
    manifests = _walk_files(os.path.join(ollama, "manifests"))
    if not manifests:
        raise errors.SourceError(f"{path}: an Ollama models folder with no manifest in manifests/")
    return _ollama(ollama, local, manifests, False, disk)


class _Store:
    """The models of a local store gathered one by one; one that cannot be read is left out with a warning when
    the store has others."""

    def __init__(self, local: ByteSource, blob: Callable[[str], str], disk: DiskCache | None, many: bool) -> None:
        self.local = local
        self.blob = blob
        self.many = many
        self.unpacker = Unpacker(local, blob, disk)
        self.groups: list[Group] = []
        self.files: dict[str, Piece] = {}
        self.left_out: list[str] = []

    def add(self, read: Callable[[], Artifact], root: str, reference: str, where: str) -> None:
        warned = len(self.unpacker.warnings)
        try:
            artifact = read()
            self._check_blobs(artifact, where)
            files = self.unpacker.files(artifact, root, where)
        except errors.SourceError as exc:
            if not self.many:
                raise
            del self.unpacker.warnings[warned:]
            self.left_out.append(f"{exc}: left out")
            return
        self.files.update(files)
        metadata = {"oci.digest": artifact.digest, "oci.reference": reference, **artifact.annotations}
        more = self.unpacker.warnings[warned:]
        self.groups.append(_group(artifact, root, metadata, self.blob, more, self.unpacker.model_folders.get(root)))

    def _check_blobs(self, artifact: Artifact, where: str) -> None:
        """Every layer's blob is there, at its size: else the model cannot be read, said naming the blob's file."""
        for layer in artifact.layers:
            path = self.blob(layer.digest)
            try:
                size = os.stat(path).st_size
            except OSError as exc:
                raise errors.SourceError(f"{path}: {exc.strerror or exc} (layer {layer.digest} of {where})") from None
            if size != layer.size:
                raise errors.SourceError(f"{path}: {size} bytes, not the {layer.size} its manifest says ({where})")

    def mapped(self, where: str, named_models: bool = False) -> MappedFiles:
        if not self.groups:
            self.unpacker.close()
            raise errors.SourceError(f"{where}: no model of the store can be read ({'; '.join(self.left_out)})")
        for line in self.left_out:
            log.warning("%s", line)
        return MappedFiles(
            self.local,
            self.files,
            self.groups,
            named_models=named_models,
            decoded=self.unpacker.decoded,
        )


def _oci_layout(folder: str, local: ByteSource, ref: str | None, disk: DiskCache | None) -> tuple[MappedFiles, str]:
    index_path = os.path.join(folder, "index.json")
    document = parse_json(_read_file(index_path), index_path)
    entries = [entry for entry in document.get("manifests") or [] if isinstance(entry, dict)]
    if not entries:
        raise errors.SourceError(f"{index_path}: the OCI layout lists no manifest")
    if ref is not None:
        chosen = [entry for entry in entries if (entry.get("annotations") or {}).get(REF_NAME) == ref]
        if not chosen:
            there = sorted(str((entry.get("annotations") or {}).get(REF_NAME)) for entry in entries)
            raise errors.SourceError(
                f"{folder}:{ref}: no manifest named {ref!r} in the OCI layout (it has: {', '.join(there)})"
            )
        entries = chosen[:1]

    def blob(digest: str) -> str:
        return os.path.join(folder, "blobs", "sha256", digest.partition(":")[2])

    store = _Store(local, blob, disk, many=len(entries) > 1)
    named: dict[str, str] = {}
    for entry in entries:
        digest = check_digest(entry.get("digest"), index_path)
        name = str((entry.get("annotations") or {}).get(REF_NAME) or "") or f"sha256-{digest[7:19]}"
        where = f"{folder} ({name})"
        name = _safe_name(name, where)
        if name in named:
            raise errors.SourceError(f"{index_path}: two manifests are named {name!r}")
        named[name] = digest
        root = folder if len(entries) == 1 else join_key(folder, name)

        def read(digest: str = digest, where: str = where) -> Artifact:
            return follow_to_manifest(lambda wanted: (_read_file(blob(wanted)), None), digest, where)

        store.add(read, root, name, where)
    return store.mapped(folder), folder


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


def _ollama(
    folder: str, local: ByteSource, manifests: list[str], single: bool, disk: DiskCache | None
) -> tuple[MappedFiles, str]:
    """The models of ``manifests`` (files below ``folder``'s ``manifests/``), each in a folder ``NAMESPACE/MODEL:TAG``
    below ``folder``; ``single``: the one manifest SOURCE named, its model at its own path."""

    def blob(digest: str) -> str:
        return os.path.join(folder, "blobs", "sha256-" + digest.partition(":")[2])

    store = _Store(local, blob, disk, many=not single)
    for manifest in manifests:
        parts = os.path.relpath(manifest, os.path.join(folder, "manifests")).split(os.sep)
        if len(parts) != 4:
            raise errors.SourceError(f"{manifest}: not manifests/HOST/NAMESPACE/MODEL/TAG of an Ollama models folder")
        host, namespace, model, tag = parts
        name = f"{namespace}/{model}:{tag}" if host == OLLAMA_HOST else f"{host}/{namespace}/{model}:{tag}"

        def read(manifest: str = manifest) -> Artifact:
            body = _read_file(manifest)
            document = parse_json(body, manifest)
            digest = "sha256:" + hashlib.sha256(body).hexdigest()
            return read_manifest(document, digest, media_type_of(document, None), manifest)

        store.add(read, manifest if single else join_key(folder, name), name, manifest)
    return store.mapped(folder, named_models=not single), manifests[0] if single else folder


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
