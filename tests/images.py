"""Container images for the tests of SPEC §14a: built by hand (layers as tars, whiteouts and links written with
``tarfile``, the manifest and config as the OCI image spec lays them out), and by the real tools (Debian's buildah
and skopeo) into a registry and an OCI layout folder."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

from tests.registry import FIXED_EPOCH, OCI_MANIFEST, Artifact, go_json, sha256_digest

IMAGE_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"


def layer_tar(members: list[tuple[str, Any]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    """A layer as a tar (of tarfile's format ``fmt``): ``(name, bytes)`` a file, ``(name, None)`` a folder, ``(name,
    ("link", target))`` a hard link, ``(name, ("symlink", target))`` a symbolic link; whiteouts are files named
    ``.wh.NAME`` (empty)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as archive:
        for name, what in members:
            info = tarfile.TarInfo(name)
            info.mtime = FIXED_EPOCH
            if what is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                archive.addfile(info)
            elif isinstance(what, tuple):
                info.type = tarfile.LNKTYPE if what[0] == "link" else tarfile.SYMTYPE
                info.linkname = what[1]
                archive.addfile(info)
            else:
                info.size = len(what)
                archive.addfile(info, io.BytesIO(what))
    return out.getvalue()


def zstd_frames(data: bytes, frame: int | None) -> bytes:
    """``data`` compressed by zstd: one frame, or a frame every ``frame`` bytes (as zstd:chunked cuts them)."""
    import zstandard

    compressor = zstandard.ZstdCompressor(level=3, write_checksum=True)  # as the zstd tool writes them
    if frame is None:
        return compressor.compress(data)
    return b"".join(compressor.compress(data[at : at + frame]) for at in range(0, len(data), frame))


def image(layers: list[bytes], compress: bool | str = True, docker: bool = False) -> Artifact:
    """An image manifest (OCI, or Docker schema 2) over ``layers`` (tars, gzip'd when ``compress``; ``"zstd"``: one
    zstd frame, ``"zstd-frames"``: a frame every 256 KiB, ``"zstd-mixed"``: those for its first 4 MiB, then one
    frame), bottom first, with an image config naming their diff IDs."""
    blobs = {}
    descriptors = []
    for tar in layers:
        if compress == "zstd-mixed":
            data = zstd_frames(tar[: 4 << 20], 256 << 10) + zstd_frames(tar[4 << 20 :], None)
            media = LAYER_TAR + "+zstd"
        elif compress in ("zstd", "zstd-frames"):
            data = zstd_frames(tar, None if compress == "zstd" else 256 << 10)
            media = LAYER_TAR + "+zstd"
        else:
            data = gzip.compress(tar, 6, mtime=0) if compress else tar
            media = (DOCKER_GZIP if docker else LAYER_GZIP) if compress else LAYER_TAR
        blobs[sha256_digest(data)] = data
        descriptors.append({"mediaType": media, "digest": sha256_digest(data), "size": len(data)})
    config = go_json(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": [sha256_digest(tar) for tar in layers]},
        }
    )
    blobs[sha256_digest(config)] = config
    media_type = DOCKER_MANIFEST if docker else OCI_MANIFEST
    manifest = {
        "schemaVersion": 2,
        "mediaType": media_type,
        "config": {
            "mediaType": DOCKER_CONFIG if docker else IMAGE_CONFIG,
            "digest": sha256_digest(config),
            "size": len(config),
        },
        "layers": descriptors,
    }
    return Artifact(manifest, media_type, blobs)


def buildah(*args: str, storage: Path) -> subprocess.CompletedProcess:
    """buildah as root with the vfs storage driver under ``storage`` (no overlay mounts, nothing left behind)."""
    command = ["buildah", "--storage-driver", "vfs", "--root", str(storage / "root"), "--runroot", str(storage / "run")]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120, check=True)


def modelcar(folder: Path, model: Path, storage: Path, ref: str, compress: bool = True) -> Path:
    """A KServe modelcar built by buildah: ``FROM scratch``, the files of ``model`` under ``/models``, committed as
    an OCI image (gzip layers, ``-D=false``; uncompressed without ``compress``: buildah's default) into the OCI
    layout folder ``folder`` as ``ref``. Returns it."""
    container = buildah("from", "scratch", storage=storage).stdout.strip()
    try:
        buildah("copy", container, str(model), "/models/", storage=storage)
        flags = ["--disable-compression=false"] if compress else ["--disable-compression"]
        buildah("commit", "-q", "--format", "oci", *flags, container, f"oci:{folder}:{ref}", storage=storage)
    finally:
        buildah("rm", container, storage=storage)
    return folder


def skopeo_copy(source: str, destination: str) -> None:
    """``skopeo copy`` as people run it to a plain-HTTP test registry."""
    subprocess.run(
        ["skopeo", "copy", "--dest-tls-verify=false", "--src-tls-verify=false", source, destination],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def tools_found() -> bool:
    return bool(shutil.which("buildah") and shutil.which("skopeo")) and os.geteuid() == 0


def index_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "index.json").read_text())
