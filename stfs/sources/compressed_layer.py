"""What a gzip and a zstd layer have in common (SPEC §14a): the compressed blob they read through ``read(key,
offset, count)``, the ``--cache-dir`` they keep what their pass makes in, its progress and the warnings it gives."""

from __future__ import annotations

import threading
from collections.abc import Callable

from .disk_cache import DiskCache
from .tar_index import Entry


class CompressedLayer:
    """The decompressed stream of the blob ``key`` (``size`` bytes, ``digest``): ``scan()`` makes or loads what
    its pass finds and gives the tar's members, ``read_at`` the stream's bytes, ``close`` lets go of them."""

    def __init__(
        self,
        read: Callable[[str, int, int], bytes],
        key: str,
        size: int,
        digest: str,
        disk: DiskCache | None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.key = key
        self.size = size
        self.digest = digest
        self._read = read
        self._disk = disk
        self._progress = progress
        self._lock = threading.Lock()
        self.warnings: list[str] = []

    def scan(self) -> list[Entry]:
        raise NotImplementedError

    def read_at(self, offset: int, count: int) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
