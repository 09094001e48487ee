"""Megatron-Core and NeMo 2's ``torch_dist`` checkpoints (SPEC §16): a DCP folder with ``common.pt`` (a
``torch.save`` of what every rank shares: the run's arguments, the iteration, sometimes tensors) and
``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``) beside ``.metadata``. One model: the DCP's tensors,
``common.pt``'s tensors under ``common/`` (read as §12's checkpoints are: interpreted, never run; its globals
outside torch's weights_only allow-list warned of), ``metadata.json``'s keys in ``metadata/``."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..base import Folder, TensorEntry, read_exact
from ..pytorch import PytorchEntry, read_checkpoint, unsafe_warnings
from .rules import InvalidDcpMetadata

COMMON = "common.pt"
METADATA_JSON = "metadata.json"
MAX_METADATA_JSON = 1 << 20  # bytes: Megatron writes a few keys


@dataclass(frozen=True, slots=True)
class CommonEntry(PytorchEntry):
    """A tensor of ``common.pt``: ``begin``/``end`` absolute in that file (``location``), gathered where strided."""

    location: str | None = None

    @property
    def file(self) -> str | None:
        return self.location


@dataclass(frozen=True, slots=True)
class Common:
    """What a ``torch_dist`` folder adds to its DCP: ``common.pt``'s tensors, ``metadata.json``'s keys, the
    warnings and ``stfs check`` problems of ``common.pt``'s globals, and the two files."""

    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str]
    warnings: tuple[str, ...]
    problems: tuple[str, ...]
    files: tuple[str, ...] = (COMMON, METADATA_JSON)


def read_common(folder: Folder, path: str) -> Common | None:
    """The ``torch_dist`` part of the DCP whose ``.metadata`` is ``path``, where its folder has both files."""
    json_size = folder.size(METADATA_JSON)  # one probe of a plain DCP's folder (remote: one request, a 404)
    common_size = folder.size(COMMON) if json_size is not None else None
    if common_size is None or json_size is None:
        return None
    if json_size > MAX_METADATA_JSON:
        raise InvalidDcpMetadata(path, f"{METADATA_JSON} is {json_size} bytes, more than {MAX_METADATA_JSON}")
    text = read_exact(folder.fetcher(METADATA_JSON), 0, json_size, f"{path} ({METADATA_JSON})")
    try:
        document = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidDcpMetadata(path, f"{METADATA_JSON} is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidDcpMetadata(path, f"{METADATA_JSON} is not a JSON object")
    metadata = {str(key): value if isinstance(value, str) else json.dumps(value) for key, value in document.items()}
    fetch = folder.fetcher(COMMON)
    checkpoint = read_checkpoint(fetch, common_size, path=f"{path} ({COMMON})", read_many=getattr(fetch, "many", None))
    tensors = tuple(
        CommonEntry(t.name, t.dtype, t.shape, t.offset, t.offset + t.nbytes, t, COMMON) for t in checkpoint.tensors
    )
    unsafe = unsafe_warnings(checkpoint)
    return Common(tensors, metadata, checkpoint.warnings + unsafe, unsafe)
