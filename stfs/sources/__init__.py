"""Byte sources: the interface (``base``) and its implementations (``local``)."""

from .base import PAGE, ByteSource, SourceChanged, SpliceSource
from .local import DEFAULT_MAX_OPEN_FILES, Expectation, LocalFiles

__all__ = ["DEFAULT_MAX_OPEN_FILES", "PAGE", "ByteSource", "Expectation", "LocalFiles", "SourceChanged",
           "SpliceSource"]
