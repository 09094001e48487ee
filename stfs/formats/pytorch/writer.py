"""The safetensors file equivalent to a checkpoint's tensors: its header (``--view safetensors``, ``header.json``)
and where each tensor's bytes go."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .checkpoint import Tensor


@dataclass(frozen=True, slots=True)
class SafetensorsFile:
    """The safetensors file holding some tensors: its header, then each tensor's bytes at ``placements``."""

    header: bytes  # 8-byte length, JSON, spaces to a multiple of 8: what the safetensors writer makes
    placements: tuple[tuple[Tensor, int], ...]  # each tensor and the absolute offset of its bytes in the file

    @property
    def size(self) -> int:
        return len(self.header) + sum(tensor.nbytes for tensor, _ in self.placements)


def safetensors_file(tensors: Sequence[Tensor]) -> SafetensorsFile:
    """The safetensors file of ``tensors`` in their order, ``__metadata__`` ``{"format": "pt"}`` (SPEC §12).

    Tied weights are two tensors and have their bytes twice, so the file is valid for the reference.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    begin = 0
    relative = []
    for tensor in tensors:
        if tensor.name in header:
            raise ValueError(f"two tensors named {tensor.name!r}")
        end = begin + tensor.nbytes
        header[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [begin, end]}
        relative.append(begin)
        begin = end
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    raw = struct.pack("<Q", len(text)) + text
    return SafetensorsFile(raw, tuple((tensor, len(raw) + at) for tensor, at in zip(tensors, relative, strict=True)))


def safetensors_header(tensors: Sequence[Tensor]) -> bytes:
    """The header (length, JSON, padding) of ``safetensors_file(tensors)``."""
    return safetensors_file(tensors).header


def header_json(tensors: Sequence[Tensor]) -> bytes:
    """``header.json`` of a checkpoint: the JSON of ``safetensors_file(tensors)``'s header, less its length and
    padding."""
    return safetensors_header(tensors)[8:].rstrip(b" ")
