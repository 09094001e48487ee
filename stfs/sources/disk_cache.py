"""Fetched pieces of remote files kept on disk across mounts (``--cache-dir``).

A piece is a file ``DIR/<hash of key and version>/<lo>-<hi>``: keyed by object *and* version, so a
changed object never hits an old piece. Written to a temporary name and renamed into place, so two
daemons sharing DIR never see half a piece; a piece found is read whole or ignored.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os

log = logging.getLogger(__name__)


class DiskCache:
    """Pieces ``[lo, hi)`` of versioned objects under ``folder``."""

    def __init__(self, folder: str) -> None:
        self.folder = os.path.abspath(folder)
        os.makedirs(self.folder, exist_ok=True)

    def _path(self, key: str, version: str, lo: int, hi: int) -> str:
        digest = hashlib.sha256(f"{key}\0{version}".encode("utf-8", "surrogateescape")).hexdigest()[:40]
        return os.path.join(self.folder, digest, f"{lo}-{hi}")

    def get(self, key: str, version: str, lo: int, hi: int) -> bytes | None:
        """The piece ``[lo, hi)`` of ``key`` at ``version``, if some daemon kept it."""
        if not version:
            return None  # without a version a piece could be of any version: never kept, never used
        try:
            with open(self._path(key, version, lo, hi), "rb") as stream:
                data = stream.read(hi - lo + 1)
        except OSError:
            return None
        return data if len(data) == hi - lo else None

    def put(self, key: str, version: str, lo: int, hi: int, data: bytes | memoryview) -> None:
        """Keep a piece; failures (a full disk) are logged, never raised: the cache is an optimisation."""
        if not version:
            return
        path = self._path(key, version, lo, hi)
        temporary = f"{path}.{os.getpid()}.{id(data)}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(temporary, "wb") as stream:
                stream.write(data)
            os.replace(temporary, path)
        except OSError as exc:
            log.warning("cannot keep a piece of %s in %s: %s", key, self.folder, exc)
            with contextlib.suppress(OSError):
                os.unlink(temporary)
