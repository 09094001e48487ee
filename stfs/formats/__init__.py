"""Formats: how the bytes of one source file become validated tensors and metadata (a ``Header``).

One module per format, each pure: a range fetcher in, a ``Header`` out, every rule of its reference a named
error, no I/O of its own. Everything downstream (models, the tree, views, ``info``, ``check``) works on
``Header`` and ``TensorEntry`` alone; ``format_of`` picks a file's format, ``groups`` says how a dtype's values
are packed, whatever format named it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from . import safetensors
from .base import Header, RangeFetcher, TensorEntry

__all__ = [
    "FORMATS",
    "GGUF",
    "PYTORCH",
    "SAFETENSORS",
    "FileFormat",
    "Header",
    "RangeFetcher",
    "TensorEntry",
    "format_of",
    "groups",
    "strided",
]


@dataclass(frozen=True, slots=True)
class FileFormat:
    """A format: its name (what ``info`` calls it), the file names it claims in a folder, and its reader
    ``read_header(fetch, *, path, file_size, mtime_ns, first_read) -> Header``."""

    name: str
    suffixes: tuple[str, ...]
    read_header: Callable[..., Header]


def _gguf_header(fetch: RangeFetcher, **where: Any) -> Header:
    from . import gguf  # the gguf package: imported by mounts that hold a GGUF file only

    return gguf.fetch_header(fetch, **where)


def _pytorch_header(fetch: RangeFetcher, **where: Any) -> Header:
    from . import pytorch  # the pickle reader: imported by mounts that hold a checkpoint only

    return pytorch.fetch_header(fetch, **where)


SAFETENSORS = FileFormat("safetensors", (".safetensors",), safetensors.fetch_header)
GGUF = FileFormat("gguf", (".gguf",), _gguf_header)
PYTORCH = FileFormat("pytorch", (".bin", ".pt", ".pth", ".ckpt"), _pytorch_header)
FORMATS: tuple[FileFormat, ...] = (SAFETENSORS, GGUF, PYTORCH)


def format_of(key: str) -> FileFormat:
    """The format of the file ``key`` by its name; a file named otherwise is read as safetensors (a SOURCE may be
    named anything)."""
    return next((known for known in FORMATS if key.endswith(known.suffixes)), SAFETENSORS)


@cache
def groups(dtype: str) -> tuple[int, int]:
    """(values, bytes) of the smallest whole group of ``dtype``'s values: F4 two values a byte, F6 four in three
    bytes, every other dtype of safetensors one value in its own bytes; a GGML type its block."""
    bits = safetensors.DTYPE_BITS.get(dtype)
    if bits is None:
        from . import gguf

        found = gguf.ggml_type(dtype)
        return found.block_size, found.type_size
    values = {4: 2, 6: 4}.get(bits, 1)
    return values, values * bits // 8


def strided(entry: TensorEntry) -> Any:
    """The strided tensor of a checkpoint behind ``entry`` (a ``pytorch.Tensor`` whose elements are gathered in C
    order); ``None`` where the tensor's bytes are one range."""
    tensor = getattr(entry, "tensor", None)
    return tensor if tensor is not None and not tensor.contiguous else None
