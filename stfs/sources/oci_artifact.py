"""What an OCI artifact holds as files (SPEC §14): a manifest's layers named and placed; no I/O.

A layer is a file of the model, named by ModelPack's ``org.cncf.model.filepath``, else ORAS's
``org.opencontainers.image.title``, else by its media type (Ollama's and Docker Model Runner's weights), else
``blobs/sha256-HEX``. An uncompressed tar layer that ModelPack types as one, or that ORAS marks
``io.deis.oras.content.unpack``, is unpacked in place (``Layer.unpack``; its members are indexed by
``stfs.sources.tar_index``), a gzip'd one read at random after one pass (``stfs.sources.gzip_layer``). A
manifest whose config is an image config and whose layers are untitled image layers is a container image
(``Layer.image``): its layers make one filesystem (``stfs.sources.image``). Other compressed layers are left out
with a warning.
"""

from __future__ import annotations

import json
import platform
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from .. import errors

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
ACCEPT = ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))

FILEPATH = "org.cncf.model.filepath"  # ModelPack
TITLE = "org.opencontainers.image.title"  # ORAS
UNPACK = "io.deis.oras.content.unpack"  # ORAS: a folder pushed as a tar
REF_NAME = "org.opencontainers.image.ref.name"  # an OCI layout's tag
CREATED = "org.opencontainers.image.created"
MODEL_ARTIFACTS = ("application/vnd.cncf.model.manifest.v1+json",)
# Layers whose media type names the file they hold (Ollama's registry, Docker Model Runner).
NAMED_BY_TYPE = {
    "application/vnd.ollama.image.model": "model.gguf",
    "application/vnd.docker.ai.safetensors": "model.safetensors",
}
DOCKER_AI_GGUF = "application/vnd.docker.ai.gguf."
MODELPACK_LAYER = re.compile(r"^application/vnd\.cncf\.model\.[a-z.]+\.v1\.(raw|tar)(\+[a-z0-9]+)?$")
COMPRESSED = re.compile(r"(\+|\.)(gzip|zstd|gz|bzip2|xz)$")
IMAGE_CONFIGS = ("application/vnd.oci.image.config.v1+json", "application/vnd.docker.container.image.v1+json")
IMAGE_LAYER = re.compile(
    r"^application/vnd\.(oci\.image\.layer\.v1\.tar|docker\.image\.rootfs\.diff\.tar)(\+gzip|\+zstd|\.gzip)?$"
)
READ_COMPRESSED = ("gzip", "zstd")  # compressions of tar layers read at random
DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")


@dataclass(frozen=True, slots=True)
class Layer:
    """One layer of an artifact: its blob, and where its bytes go in the artifact's folder: the file ``name``, or
    (``unpack``) a tar whose members go to their paths, below ``name`` where that is not empty (ORAS's title)."""

    digest: str
    size: int
    media_type: str
    name: str
    unpack: bool = False
    compression: str = ""  # "gzip", "zstd": a compressed tar
    image: bool = False  # a container image's layer: applied over the ones before it


@dataclass(frozen=True, slots=True)
class Artifact:
    """A manifest read: its digest, annotations, the layers stfs reads, and warnings for those it leaves out."""

    digest: str
    media_type: str
    annotations: Mapping[str, str]
    layers: tuple[Layer, ...]
    warnings: tuple[str, ...] = field(default=())
    created: str | None = None  # when the artifact was made, as the manifest or its config says (RFC 3339)

    @property
    def hex(self) -> str:
        return self.digest.partition(":")[2]


def parse_json(body: bytes, where: str) -> dict:
    """A manifest or index document: a JSON object, else a ``SourceError`` naming ``where``."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise errors.SourceError(f"{where}: the manifest is not valid JSON ({exc})") from None
    if not isinstance(document, dict):
        raise errors.SourceError(f"{where}: the manifest is not a JSON object")
    return document


def media_type_of(document: dict, told: str | None) -> str:
    """A document's media type: its own ``mediaType``, else the one the server said, else what its members say."""
    own = document.get("mediaType")
    if isinstance(own, str) and own:
        return own
    if told and told.split(";")[0].strip() in (*MANIFEST_TYPES, *INDEX_TYPES):
        return told.split(";")[0].strip()
    return OCI_INDEX if "manifests" in document else OCI_MANIFEST


def check_digest(digest: object, where: str) -> str:
    if not isinstance(digest, str) or DIGEST.match(digest) is None:
        raise errors.SourceError(f"{where}: {digest!r} is not a sha256 digest stfs can check")
    return digest


def choose_manifest(index: dict, where: str) -> str:
    """The digest of the manifest an image index stands for: its only one; else the one for this host's platform,
    or the one whose ``artifactType`` is a model's; else a ``SourceError`` listing them."""
    entries = [entry for entry in index.get("manifests") or [] if isinstance(entry, dict)]
    if not entries:
        raise errors.SourceError(f"{where}: the image index lists no manifest")
    if len(entries) == 1:
        return check_digest(entries[0].get("digest"), where)
    machine = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    for wanted in (
        lambda entry: entry.get("artifactType") in MODEL_ARTIFACTS,
        lambda entry: (
            (entry.get("platform") or {}).get("os") == "linux"
            and (entry.get("platform") or {}).get("architecture") == machine
        ),
    ):
        chosen = [entry for entry in entries if wanted(entry)]
        if len(chosen) == 1:
            return check_digest(chosen[0].get("digest"), where)
    listed = "; ".join(_described(entry) for entry in entries)
    raise errors.SourceError(f"{where}: the image index lists {len(entries)} manifests, none for this host: {listed}")


def _described(entry: dict) -> str:
    plat = entry.get("platform") or {}
    what = "/".join(str(plat[part]) for part in ("os", "architecture", "variant") if plat.get(part))
    what = what or entry.get("artifactType") or entry.get("mediaType") or "?"
    return f"{entry.get('digest')} ({what})"


def read_manifest(document: dict, digest: str, media_type: str, where: str, config: dict | None = None) -> Artifact:
    """The ``Artifact`` a manifest describes; a ``SourceError`` naming ``where`` if no layer is one stfs reads."""
    layers: list[Layer] = []
    warnings: list[str] = []
    config_type = (document.get("config") or {}).get("mediaType") if isinstance(document.get("config"), dict) else None
    image = config_type in IMAGE_CONFIGS
    for number, layer in enumerate(document.get("layers") or []):
        if not isinstance(layer, dict):
            raise errors.SourceError(f"{where}: layer {number} is not a JSON object")
        made = _layer(layer, number, where, warnings, image)
        if made is not None:
            layers.append(made)
    if not layers:
        raise errors.SourceError(f"{where}: the manifest has no layer stfs can read" + _why(warnings))
    annotations = {str(k): str(v) for k, v in (document.get("annotations") or {}).items()}
    created = annotations.get(CREATED) or (config or {}).get("created")
    return Artifact(digest, media_type, annotations, tuple(layers), tuple(warnings), created or None)


def _why(warnings: list[str]) -> str:
    return f" ({'; '.join(warnings)})" if warnings else ""


def compression_of(media_type: str) -> str:
    """``gzip``, ``zstd``, another compression's name, or ``""`` for an uncompressed media type."""
    found = COMPRESSED.search(media_type)
    if found is None:
        return ""
    return {"gz": "gzip"}.get(found.group(2), found.group(2))


def _layer(layer: dict, number: int, where: str, warnings: list[str], image: bool) -> Layer | None:
    digest = check_digest(layer.get("digest"), f"{where}: layer {number}")
    size = layer.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise errors.SourceError(f"{where}: layer {digest} has no valid size")
    media_type = str(layer.get("mediaType") or "")
    annotations = layer.get("annotations") or {}
    named = annotations.get(FILEPATH) or annotations.get(TITLE)
    modelpack = MODELPACK_LAYER.match(media_type)
    tar = (modelpack is not None and modelpack.group(1) == "tar") or str(annotations.get(UNPACK)).lower() == "true"
    compression = compression_of(media_type)
    if image and not named and IMAGE_LAYER.match(media_type):
        tar = True
    elif compression and not tar:
        warnings.append(
            f"layer {digest} ({named or media_type}) is a compressed file, not a tar: left out "
            "(push the file uncompressed, or in a tar layer)"
        )
        return None
    if compression and compression not in READ_COMPRESSED:
        warnings.append(
            f"layer {digest} ({named or media_type}): stfs reads no {compression} layer: left out "
            "(copy the image with gzip or uncompressed layers: skopeo copy --dest-compress-format gzip)"
        )
        return None
    if tar:
        # ModelPack's tar holds its files at their paths from the model's root; ORAS's, below its title
        base = "" if modelpack is not None or image else _checked_name(str(named or ""), digest, where, True)
        is_image = image and not named and IMAGE_LAYER.match(media_type) is not None
        return Layer(digest, size, media_type, base, unpack=True, compression=compression, image=is_image)
    if not named:
        named = NAMED_BY_TYPE.get(media_type)
        if named is None and media_type.startswith(DOCKER_AI_GGUF):
            named = "model.gguf"
    name = _checked_name(str(named), digest, where) if named else f"blobs/sha256-{digest.partition(':')[2]}"
    return Layer(digest, size, media_type, name)


def _checked_name(name: str, digest: str, where: str, allow_empty: bool = False) -> str:
    """A layer's file name as a relative path inside the mount, normalised; a ``SourceError`` if it leaves it."""
    if not name and allow_empty:
        return ""
    normal = posixpath.normpath(name)
    if not name or name.startswith("/") or normal == ".." or normal.startswith("../") or "\0" in name:
        raise errors.SourceError(f"{where}: layer {digest} names {name!r}, which is not a path inside the model")
    return "" if normal == "." and allow_empty else normal


def member_path(layer: Layer, member: str) -> str | None:
    """Where a tar member of ``layer`` goes in the artifact's folder (ORAS's members already start with the title;
    others are put below it), or ``None`` for a member whose path leaves the folder (it is left out)."""
    path = member[2:] if member.startswith("./") else member
    normal = posixpath.normpath(path) if path else "."
    if normal in (".", "..") or normal.startswith("../") or path.startswith("/"):
        return None
    base = layer.name
    if base and normal != base and not normal.startswith(base + "/"):
        normal = posixpath.join(base, normal)
    return normal
