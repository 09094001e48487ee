"""What ``RemoteFiles`` is built on: a remote store's ``Transport`` (how keys map to it and the calls made of it),
what a listing says of a file (``Listing``), a pinned version (``Pin``), the errors of a read, and the few pipe and
failure helpers the block cache's readers share."""

from __future__ import annotations

import fcntl
import os
import struct
import termios
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .base import Kind, SourceChanged
from .failures import FATAL, describe, first_line

if TYPE_CHECKING:
    from .http_client import HttpClient, ResolvingClient, SignedClient


class DeadlineSpent(OSError):
    """A request retried until its ``deadline`` and given up: a read with a later deadline may ask again."""

    def __init__(self, message: str, deadline: float) -> None:
        super().__init__(message)
        self.deadline = deadline


class RangeIgnored(OSError):
    """The server answered a Range request with the whole object (200): a mount cannot be served from it."""


@dataclass(frozen=True, slots=True)
class Listing:
    """What a remote source can say of a key without reading it: a file, a folder, or nothing; for a file its
    store's listing gave (S3's list, the Hub's file list), enough to pin it without a request: ``size``, the
    ``etag`` sent as If-Match (``None``: the URL pins it, as a Hub commit does), ``tag`` naming the version in
    the disk cache, and ``mtime_ns``."""

    kind: Kind | None
    size: int | None = None
    etag: str | None = None
    tag: str | None = None
    mtime_ns: int = 0


# Files whose first bytes every mount reads (headers, indexes): their speculative first read pins them and keeps
# those bytes. Any other file of a listing is pinned from the listing, and costs nothing until it is read.
READ_AT_MOUNT = (".safetensors", ".safetensors.index.json")


class Transport:
    """One remote store: how a key maps to it, and the calls stfs makes of it (all through obstore).

    Subclasses (``stfs.sources.urls``) give ``make_store`` and, where the store can list, ``list``.
    """

    base: str  # the key prefix this store serves, e.g. "https://host:8080" or "s3://bucket"

    def make_store(self) -> Any:
        raise NotImplementedError

    def path(self, key: str) -> str:
        return key[len(self.base) :].lstrip("/")

    def store_path(self, key: str) -> str:
        """``path(key)`` as obstore takes it: the object's name, which obstore encodes for the request itself."""
        return self.path(key)

    def list(self, store: Any, key: str) -> list[str] | None:
        """Keys of every file at or below ``key`` (a file or a folder), sorted; ``None`` if the store cannot list."""
        return None

    def sha256(self, key: str) -> str | None:
        """The sha256 the store's listing gives for ``key`` (the Hub's, of an LFS file), else ``None``."""
        return None

    def refuse_if_expired(self) -> None:
        """Raise, with no request made, once the server has refused the URL itself (an expired presigned URL)."""

    def shown(self, exc: Exception) -> Exception:
        """``exc`` as it may be raised and shown: another exception of its kind where its text holds a secret."""
        return exc

    def read_range(self, key: str, lo: int, hi: int) -> memoryview | None:
        """Bytes ``[lo, hi)`` of ``key`` fetched the transport's own way (a registry's blobs); ``None``: through
        obstore, as every other transport does."""
        return None

    def client(self) -> HttpClient | ResolvingClient | SignedClient | None:
        """A client that reads a range straight into memory given (HTTP(S), the Hub, S3); ``None``: through obstore."""
        return None

    def lookups(self) -> int:
        """Requests its client made to find where files are (the Hub's HEADs); none where no client was made."""
        return 0

    def prepare(self) -> None:
        """Work a mount does at once, off the read path, so that the first read does not (none here)."""

    def describe(self, key: str) -> Listing | None:
        """What the store knows of ``key`` without a request (the Hub's file list, an S3 listing already made);
        else ``None``."""
        return None

    def still_there(self, store: Any, key: str, etag: str | None, version: str | None, size: int) -> bool:
        """Whether ``key`` still holds the object pinned as ``etag``/``version``/``size``: one request (a HEAD).
        ``FileNotFoundError`` if nothing is there; any other error if the server cannot say."""
        import obstore

        meta = obstore.head(store, self.path(key))
        if version:
            return bool(meta.get("version") == version)
        return bool(meta["size"] == size and (not etag or meta.get("e_tag") == etag))


class Pin:
    """A remote file as first seen: its size and version (every later read must find it), its first bytes."""

    __slots__ = ("key", "size", "etag", "version", "mtime_ns", "head", "changed", "label")

    def __init__(
        self,
        key: str,
        size: int,
        etag: str | None,
        version: str | None,
        mtime_ns: int,
        head: bytes,
        label: str | None = None,
    ) -> None:
        self.key = key
        self.size = size
        self.etag = etag
        self.version = version
        self.mtime_ns = mtime_ns
        self.head = head  # the first bytes, from the speculative first read
        self.changed = False
        self.label = label  # names the version where neither etag nor version does (a Hub file: its oid)

    @property
    def tag(self) -> str:
        """What names this version of the object (the disk cache's key beside the URL)."""
        return self.version or self.etag or self.label or ""


def write_some(pipe: int, data: bytes) -> int:
    try:
        return os.write(pipe, data)
    except BlockingIOError:
        return 0


def splice_some(fd: int, offset: int, count: int, pipe: int) -> int:
    """``splice`` ``count`` bytes of ``fd`` at ``offset`` into the non-blocking ``pipe``; the count moved."""
    done = 0
    while done < count:
        try:
            moved = os.splice(fd, pipe, count - done, offset_src=offset + done)
        except BlockingIOError:
            break
        if moved <= 0:
            break
        done += moved
    return done


def pipe_empty(pipe: int) -> bool:
    return struct.unpack("i", fcntl.ioctl(pipe, termios.FIONREAD, b"\0\0\0\0"))[0] == 0


class NoRange(OSError):
    """A Range request answered without a range: an empty object, or a server that ignores Range."""


def kind_of(exc: BaseException) -> str:
    """How to take a failed request (``failures``): ``gone`` (404), ``changed`` (412: If-Match failed), ``no-range``
    (200 or 416 to a Range request), ``fatal`` (a certificate, another 4xx: asking again will not help),
    ``unreachable`` (refused, no such host), else ``retry`` (resets, timeouts, 5xx, 429)."""
    if isinstance(exc, (RangeIgnored, SourceChanged)):
        return FATAL
    return describe(exc).kind


def one_line(exc: BaseException) -> str:
    """The cause of a failed request for a person: one line, its source named by the caller."""
    if isinstance(exc, (RangeIgnored, SourceChanged, NoRange)):
        return first_line(exc)
    return describe(exc).cause
