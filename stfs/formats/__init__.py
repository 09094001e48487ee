"""Model file formats, each a pure module: a range reader in, validated tensors and metadata out.

``gguf`` is the first here; safetensors (``stfs.format``) and PyTorch checkpoints join behind the same seam
when the format layer lands (issue 32).
"""

from __future__ import annotations

from collections.abc import Callable

RangeReader = Callable[[int, int], bytes]  # (offset, size) -> bytes, short only at the end of the file
