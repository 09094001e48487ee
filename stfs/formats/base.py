"""What every format gives the rest of stfs: a file's validated tensors and metadata, and where its header is."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

RangeFetcher = Callable[[int, int], bytes]  # (offset, size) -> bytes, short only at the end of the file


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a file; ``begin``/``end`` are relative to its data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    namespace: ClassVar[str] = "safetensors"  # its files' extended attributes: user.<namespace>.name, ...

    @property
    def size(self) -> int:
        return self.end - self.begin

    @property
    def parameters(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Header:
    """A validated header of the file at ``path``: its tensors (in the order the file lists them), its metadata
    as strings, where its data section starts, and its ``header.json``: the JSON as stored at ``json_at`` (offset,
    length) in the file, or ``json_made``, made from a header that is not JSON."""

    path: str
    file_size: int
    mtime_ns: int
    tensors: tuple[TensorEntry, ...]
    metadata: Mapping[str, str]
    digest: bytes  # of the header bytes: tells two headers apart (diagnostics)
    data_start: int
    json_at: tuple[int, int] | None = None
    json_made: bytes | None = None
    parsed: Any = None  # the format's own header, where checks across files need it (a GGUF split set)

    @property
    def data_size(self) -> int:
        return self.file_size - self.data_start
