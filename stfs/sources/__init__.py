"""Byte sources: the interface (``base``), its implementations (``local``), and the one that SOURCE names."""

import os

from .base import (
    PAGE,
    ByteSource,
    FileInfo,
    Kind,
    SourceChanged,
    SpliceSource,
    base_name,
    join_key,
    parent_key,
    relative_key,
)
from .local import LocalFiles, descriptor_budget

__all__ = [
    "PAGE",
    "ByteSource",
    "FileInfo",
    "Kind",
    "LocalFiles",
    "SourceChanged",
    "SpliceSource",
    "descriptor_budget",
    "base_name",
    "join_key",
    "parent_key",
    "relative_key",
]


def open_source(
    text: str, *, max_open_files: int | None = None, threads: bool = False, keep_source_cache: bool = False
) -> tuple[ByteSource, str]:
    """The byte source SOURCE (as given on the command line) lives in, and its key there.

    ``keep_source_cache`` leaves a local source's page cache alone instead of dropping pages once
    served (local.py); ``threads`` says requests may come from several threads at once.
    """
    source = LocalFiles(max_open=max_open_files, drop_behind=not keep_source_cache, threaded=threads)
    return source, os.path.abspath(text)
