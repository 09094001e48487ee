"""stfs: mount safetensors models read-only, every tensor an ordinary file."""

from __future__ import annotations

import os

# mfusepy chooses its libfuse once, when first imported: without a name it takes libfuse2 where one is installed
# beside libfuse3 (Ubuntu desktops have it, for AppImages). Set before anything of stfs can import mfusepy, so an
# import of mfusepy after stfs's takes libfuse3; stfs._libfuse reloads one imported before it.
os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")

__version__ = "0.2.0"

from .daemon import mounted  # noqa: E402

__all__ = ["__version__", "mounted"]
