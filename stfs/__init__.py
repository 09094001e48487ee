"""stfs: mount safetensors models read-only, every tensor an ordinary file."""

from __future__ import annotations

__version__ = "0.2.0"

from .daemon import mounted  # noqa: E402

__all__ = ["__version__", "mounted"]
