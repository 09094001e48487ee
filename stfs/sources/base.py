"""The interface every byte source implements: where the files of a mount and their bytes come from.

A source names its files by *keys*: absolute paths for local files, a URL without credentials for a
remote object. Keys appear in ``user.safetensors.file`` and in error messages. Folders of keys are
``/``-separated below an optional ``scheme://authority`` prefix; ``join_key``, ``parent_key`` and
``relative_key`` do the path arithmetic for every kind of key, so discovery never needs ``os.path``.

To add a source: write one class with the methods of ``ByteSource`` (and ``splice_into`` if its bytes
can go into a pipe by reference) and add it to the contract suite, tests/test_source_contract.py.
"""

from __future__ import annotations

import posixpath
import re
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, runtime_checkable

PAGE = 4096
URL_SCHEMES = ("http://", "https://", "s3://", "hf://", "oci://")
# Other spellings of those (``named_source`` rewrites them): skopeo's and podman's registry reference, docker://.
SCHEME_ALIASES = {"docker": "oci"}
DEFAULT_CACHE_SIZE = 1 << 30  # remote sources: fetched blocks kept in memory
DEFAULT_TIMEOUT = 30.0  # remote sources: seconds before a read gives up


def is_url(text: str) -> bool:
    """Whether a SOURCE names a remote source (``stfs.sources.urls``) rather than a local path."""
    return text.startswith(URL_SCHEMES)


_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@")


def shown_url(url: str) -> str:
    """``url`` as an error may show it, whether it parses or not: without its user and password, or its query (a
    presigned URL's signature)."""
    return _USERINFO.sub(r"\1", url).partition("?")[0]


def url_problem(url: str) -> str | None:
    """Why an http(s) URL cannot be used, in a few words (its host or port does not parse, it has no host), or
    ``None``. Never the text taken for a port: it may be a password missing its ``@``."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (the port is parsed when asked for)
    except ValueError as exc:
        if "port" in str(exc).lower():
            return "the port is not a number from 0 to 65535"
        return str(exc)[:1].lower() + str(exc)[1:]  # "invalid IPv6 URL"
    return None if parts.hostname else "no host"


_PREFIX = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/]*")


class Kind(Enum):
    """What a key names."""

    FILE = "file"
    FOLDER = "folder"
    OTHER = "other"  # exists, but neither (a device, a socket, a dangling link)


@dataclass(frozen=True, slots=True)
class FileInfo:
    """A file of a source as it is now: ``version`` changes whenever its bytes may have (local: device,
    inode, size and mtime; remote: an ETag, a VersionId or a commit)."""

    key: str
    size: int
    mtime_ns: int
    version: str


class SourceChanged(OSError):
    """A source no longer holds the bytes it was mounted with (maps to EIO)."""


@runtime_checkable
class ByteSource(Protocol):
    """Lists, describes and reads the files of one source."""

    first_read: int  # bytes a header's first read asks for: 8 locally, ~100 KB where a request is costly
    remote: bool  # bytes come over a network: what the kernel reads around a jump is fetched (readahead.py)
    concurrency: int  # headers read at once: 1 locally, many where each read waits on a network

    @property
    def warnings(self) -> Sequence[str]:
        """What a mount of this source should say on stderr besides its models' warnings (a remote file read whole,
        its server ignoring Range), gathered while its files were pinned."""
        ...

    def kind(self, key: str) -> Kind | None:
        """What ``key`` names, or ``None`` if nothing."""
        ...

    def walk(self, folder: str) -> list[str]:
        """The keys of every entry below ``folder`` that is not a folder, at any depth, sorted."""
        ...

    def stat(self, key: str) -> FileInfo:
        """Size, modification time and version of the file ``key``; ``OSError`` if it cannot be had.

        The first ``stat`` or read of a file pins its version: every later read returns the bytes of
        that version or fails with ``SourceChanged`` (a mount is a snapshot)."""
        ...

    def read(self, key: str, offset: int, size: int) -> bytes:
        """``size`` bytes of ``key`` from ``offset``; fewer only at its end; ``OSError`` on failure."""
        ...

    def changed(self) -> list[str]:
        """The keys, sorted, of the files read so far whose key no longer holds the version first seen
        (changed in place, replaced, deleted), asked now."""
        ...

    def read_into(self, key: str, offset: int, buffer: memoryview, span: tuple[int, int] | None = None) -> int:
        """Fill ``buffer`` with the bytes of ``key`` at ``offset``; return the count, short only at its end.

        ``span`` is the range of the file being read (a tensor): a remote source keeps its fetches and
        readahead inside it."""
        ...

    def listed_sha256(self, key: str) -> str | None:
        """The sha256 of the file ``key`` as the store lists it, without reading the file (the Hub's LFS files);
        ``None`` where the store says none."""
        ...

    def close(self) -> None:
        """Release what the source holds (descriptors, connections)."""
        ...


@runtime_checkable
class SpliceSource(ByteSource, Protocol):
    """A source whose bytes can go into a pipe by reference (``splice``), never through user space."""

    def splice_into(self, key: str, offset: int, count: int, pipe: int, span: tuple[int, int] | None = None) -> int:
        """Move ``count`` bytes of ``key`` at ``offset`` into the non-blocking pipe ``pipe``; the count moved,
        short only when the pipe is full. ``span`` is as for ``read_into``."""
        ...


class SharedBlocks(Protocol):
    """A reader of a remote source's block cache of its own (stfs._native), told which bytes its slots hold.

    The source publishes a slot's bytes once it has answered a read from them itself (its readahead then sees the
    first read of every block) and withdraws the slot before it reuses it; the reader answers reads of published
    bytes from the cache's memfd. Called with the source's lock held."""

    def publish(self, slot: int, key: str, block: int, lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` of ``key`` (in ``block``) are in ``slot`` and stay there until it is withdrawn."""
        ...

    def withdraw(self, slot: int) -> bool:
        """No more reads from ``slot``; whether none of the reader's replies still holds its pages (if one does,
        the slot must not be reused yet: ask again later)."""
        ...

    def changed(self, key: str) -> None:
        """``key`` no longer holds its pinned version: the reader leaves its reads to the source (EIO)."""
        ...


def _split(key: str) -> tuple[str, str]:
    match = _PREFIX.match(key)
    return (match.group(), key[match.end() :]) if match else ("", key)


def join_key(folder: str, relative: str) -> str:
    """The key of ``relative`` (a ``/``-separated path, normalised) inside ``folder``."""
    prefix, path = _split(folder)
    return prefix + posixpath.normpath(posixpath.join(path or "/", relative))


def parent_key(key: str) -> str:
    """The folder holding ``key``."""
    prefix, path = _split(key)
    return prefix + posixpath.dirname(path)


def relative_key(root: str, key: str) -> str:
    """``key``'s path below the folder ``root``."""
    return posixpath.relpath(_split(key)[1], _split(root)[1] or "/")


def base_name(key: str) -> str:
    """The last component of ``key``."""
    return posixpath.basename(_split(key)[1])
