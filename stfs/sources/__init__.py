"""Byte sources: the interface (``base``), its implementations (``local``), and the one that SOURCE names."""

import os
import re

from .. import errors
from .base import (
    DEFAULT_CACHE_SIZE,
    DEFAULT_TIMEOUT,
    PAGE,
    SCHEME_ALIASES,
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
    shown_url,
    url_problem,
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
    "named_source",
    "join_key",
    "parent_key",
    "relative_key",
]


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
OCI_LAYOUT_PREFIX = "oci:"  # skopeo's oci:PATH[:REF]


def named_source(text: str) -> str:
    """SOURCE as given on the command line, as stfs reads it: a URL with its scheme in lower case (an alias such as
    ``docker://`` as the scheme it stands for), else the local path unchanged. A URL stfs cannot read (a scheme it
    does not serve, a host or port that does not parse) is a ``SourceError`` in one line that shows no
    credentials; a local path of that shape that exists is a path."""
    match = _SCHEME.match(text)
    if match is None:
        return text
    scheme = match[1].lower()
    url = SCHEME_ALIASES.get(scheme, scheme) + text[len(scheme) :]
    shown = shown_url(url)
    if not is_url(url):
        if os.path.exists(text):
            return text
        raise errors.SourceError(f"{shown}: not a source stfs reads (a local path, or an http(s), s3, hf or oci URL)")
    problem = url_problem(url) if scheme in ("http", "https") else None
    if problem is not None:
        raise errors.SourceError(f"{shown}: not a valid URL: {problem}")
    return url


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
    plain_http: bool = False,
) -> tuple[ByteSource, str]:
    """The byte source SOURCE (as given on the command line) lives in, and its key there.

    A URL (``http(s)://``, ``s3://``, ``hf://``, ``oci://``) is a remote source (``cache_size``, ``timeout``,
    ``cache_dir``, ``cache_dir_size`` apply; ``mounting`` refuses a server that ignores Range; ``plain_http`` lets
    a registry that is not on a loopback host be asked over HTTP); anything else a local path (``keep_source_cache``
    leaves the source's page cache alone instead of dropping pages once served; ``threads``: requests may come
    from several threads at once): an OCI image layout folder or an Ollama models folder (or manifest) is the
    folder of files its artifacts make, blobs read in place.
    """
    if not is_url(text) and _SCHEME.match(text) is not None and not os.path.exists(text):
        text = named_source(text)  # docker://…: named as the command line names it
    if is_url(text):
        from .urls import open_remote  # obstore and its threads: only for the sources that need them

        return open_remote(
            text,
            cache_size=cache_size or DEFAULT_CACHE_SIZE,
            timeout=timeout or DEFAULT_TIMEOUT,
            cache_dir=cache_dir,
            cache_dir_size=cache_dir_size,
            ranges_required=mounting,
            plain_http=plain_http,
        )
    path, ref = store_reference(text)
    source = LocalFiles(max_open=max_open_files, drop_behind=not keep_source_cache, threaded=threads)
    from .oci import open_local_store

    try:
        store = open_local_store(path, source, ref, cache_dir, cache_dir_size)
    except BaseException:
        source.close()
        raise
    if store is not None:
        return store
    return source, os.path.abspath(text)


def store_reference(text: str) -> tuple[str, str | None]:
    """A local SOURCE as a path and the ref name it selects in an OCI layout folder: ``PATH:REF`` or skopeo's
    ``oci:PATH[:REF]`` where PATH is such a folder (a path that exists is itself, colons and all)."""
    if os.path.exists(text):
        return text, None
    rest = text[len(OCI_LAYOUT_PREFIX) :] if text.startswith(OCI_LAYOUT_PREFIX) else text
    if os.path.exists(rest):
        return rest, None
    path, colon, ref = rest.rpartition(":")
    if colon and path and ref and os.path.isfile(os.path.join(path, "oci-layout")):
        return path, ref
    return rest, None
