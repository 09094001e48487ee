"""What the remote tests share: models laid out in a local folder, published to a server, and mounts walked and
compared; reads that bypass the page cache."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.models import rich_arrays, sharded_arrays, write_numpy, write_sharded
from tests.servers import S3, FakeHub, Nginx

MIB = 1 << 20
KEYED_XATTRS = ("user.safetensors.file",)  # differ between a local and a remote mount by design


@dataclass(frozen=True, slots=True)
class Entry:
    """One path of a mount as a reader sees it."""

    kind: str  # "dir" or "file"
    mode: int
    size: int
    digest: str  # sha256 of the bytes of a file, "" for a folder
    xattrs: tuple[tuple[str, bytes], ...]  # every xattr but those in KEYED_XATTRS


def walk(mnt: str) -> dict[str, Entry]:
    """Every path below ``mnt`` (relative), with its kind, mode, size, bytes' digest and xattrs."""
    found: dict[str, Entry] = {}
    for folder, dirs, files in os.walk(mnt):
        for name in dirs + files:
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, mnt)
            info = os.stat(path)
            xattrs = tuple(
                sorted((attr, os.getxattr(path, attr)) for attr in os.listxattr(path) if attr not in KEYED_XATTRS)
            )
            if name in files:
                with open(path, "rb") as stream:
                    digest = hashlib.sha256(stream.read()).hexdigest()
                found[relative] = Entry("file", info.st_mode, info.st_size, digest, xattrs)
            else:
                found[relative] = Entry("dir", info.st_mode, 0, "", xattrs)
    return found


def source_xattrs(mnt: str) -> dict[str, str]:
    """``user.safetensors.file`` of every file below ``mnt`` that has one."""
    found = {}
    for folder, _, files in os.walk(mnt):
        for name in files:
            path = os.path.join(folder, name)
            if "user.safetensors.file" in os.listxattr(path):
                found[os.path.relpath(path, mnt)] = os.getxattr(path, "user.safetensors.file").decode()
    return found


def wait_for(ready: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout} s")
        time.sleep(0.05)


# --- models in a local folder ---------------------------------------------------------------------------


def files_of(folder: Path) -> dict[str, bytes]:
    """Every regular file below ``folder``: relative path -> bytes."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def one_file(folder: Path) -> Path:
    """A folder holding one model file with every numpy dtype and metadata."""
    folder.mkdir(parents=True, exist_ok=True)
    write_numpy(str(folder / "rich.safetensors"), rich_arrays(), metadata={"format": "pt"})
    return folder / "rich.safetensors"


def sharded(folder: Path) -> Path:
    """A folder holding a two-shard set; the index's path."""
    return Path(write_sharded(str(folder), sharded_arrays(), metadata={"model-00001-of-00002.safetensors": {"a": "1"}}))


def repository(folder: Path) -> Path:
    """A folder like a model repository: a sharded set, config.json, tokenizer files and an empty file."""
    sharded(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "toy", "hidden_size": 8}))
    (folder / "tokenizer").mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer" / "vocab.txt").write_bytes(bytes(range(256)) * 10)
    (folder / "empty.txt").write_bytes(b"")
    return folder


def several_models(folder: Path) -> Path:
    """A folder of several models (a diffusers-like repository) with other files beside them."""
    (folder / "unet").mkdir(parents=True, exist_ok=True)
    write_numpy(str(folder / "unet" / "diffusion_pytorch_model.safetensors"), rich_arrays(3))
    sharded(folder / "text_encoder")
    one_file(folder / "vae")
    (folder / "model_index.json").write_text('{"_class_name": "Toy"}')
    (folder / "unet" / "config.json").write_text('{"sample_size": 8}')
    return folder


def big_model(path: Path, tensors: int, tensor_bytes: int, seed: int = 0) -> Path:
    """A model of ``tensors`` U8 tensors of ``tensor_bytes`` random bytes each (not block-aligned sizes welcome)."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_numpy(
        str(path), {f"layers.{i}.weight": rng.integers(0, 256, tensor_bytes, dtype=np.uint8) for i in range(tensors)}
    )
    return path


def zero_model(path: Path, tensors: int, tensor_bytes: int) -> Path:
    """A large model of zeros written sparsely: cheap to make, served like any other file."""
    header: dict[str, object] = {}
    for i in range(tensors):
        header[f"layers.{i}.weight"] = {
            "dtype": "U8",
            "shape": [tensor_bytes],
            "data_offsets": [i * tensor_bytes, (i + 1) * tensor_bytes],
        }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(raw)) + raw)
        stream.truncate(8 + len(raw) + tensors * tensor_bytes)
    return path


def big_header_model(path: Path, header_bytes: int, data_bytes: int = MIB) -> Path:
    """One tensor and a header padded with metadata to about ``header_bytes``."""
    rng = np.random.default_rng(5)
    write_numpy(
        str(path), {"weight": rng.integers(0, 256, data_bytes, dtype=np.uint8)}, metadata={"pad": "x" * header_bytes}
    )
    return path


# --- publishing ------------------------------------------------------------------------------------------


def publish_nginx(nginx: Nginx, folder: Path, prefix: str) -> str:
    """Serve every file of ``folder`` under ``prefix``; the URL of that folder."""
    for relative, data in files_of(folder).items():
        nginx.put(f"{prefix}/{relative}", data)
    return f"{nginx.url}/{prefix}"


def publish_s3(s3: S3, folder: Path, bucket: str, prefix: str, versioned: bool = False) -> str:
    """Put every file of ``folder`` in ``bucket`` under ``prefix``; ``s3://bucket/prefix``."""
    s3.create_bucket(bucket, versioned=versioned)
    for relative, data in files_of(folder).items():
        s3.put_object(bucket, f"{prefix}/{relative}", data)
    return f"s3://{bucket}/{prefix}"


def publish_hub(hub: FakeHub, folder: Path, org: str = "org", repo: str = "repo") -> str:
    """Commit every file of ``folder`` as the repository's tree; the commit."""
    return hub.publish_repo(org, repo, files_of(folder))
