"""Byte sources: the interface (``base``), its implementations (``local``), and the one that SOURCE names."""

import os

from .base import (
    DEFAULT_CACHE_SIZE,
    DEFAULT_TIMEOUT,
    PAGE,
    ByteSource,
    FileInfo,
    Kind,
    SharedBlocks,
    SourceChanged,
    SpliceSource,
    base_name,
    is_url,
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
    "SharedBlocks",
    "SourceChanged",
    "SpliceSource",
    "descriptor_budget",
    "base_name",
    "join_key",
    "parent_key",
    "relative_key",
]


def open_source(
    text: str,
    *,
    max_open_files: int | None = None,
    threads: bool = False,
    keep_source_cache: bool = False,
    cache_size: int | None = None,
    timeout: float | None = None,
    cache_dir: str | None = None,
    cache_dir_size: int | None = None,
    mounting: bool = False,
) -> tuple[ByteSource, str]:
    """The byte source SOURCE (as given on the command line) lives in, and its key there.

    A URL (``http(s)://``, ``s3://``, ``hf://``) is a remote source (``cache_size``, ``timeout``,
    ``cache_dir``, ``cache_dir_size`` apply; ``mounting`` refuses a server that ignores Range); anything else a
    local path (``keep_source_cache`` leaves the source's page cache alone instead of dropping pages once served;
    ``threads``: requests may come from several threads at once).
    """
    if is_url(text):
        from .urls import open_remote  # obstore and its threads: only for the sources that need them

        return open_remote(
            text,
            cache_size=cache_size or DEFAULT_CACHE_SIZE,
            timeout=timeout or DEFAULT_TIMEOUT,
            cache_dir=cache_dir,
            cache_dir_size=cache_dir_size,
            ranges_required=mounting,
        )
    source = LocalFiles(max_open=max_open_files, drop_behind=not keep_source_cache, threaded=threads)
    return source, os.path.abspath(text)
