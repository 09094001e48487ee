"""Reads that just failed with EIO, so that the kernel's second ask for the same bytes fails at once.

The kernel reads a file ahead of its reader. When that read fails, it asks once more itself for the page the reader
is at (``filemap_read_folio`` after a failed readahead; ``filemap_fault`` for a mapping) before it hands the reader
EIO: the same read, of the same process, which must not wait out ``--timeout`` a second time (a dead server took
twice ``--timeout`` to give a reader its EIO). A read by the same process of the same file, at an offset that a read
which failed within ``WINDOW`` seconds covered, is that second ask: it fails at once, and the failures remembered for
that process and file are forgotten (the reader has its EIO; its next read asks the source again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

WINDOW = 1.0  # seconds after a failed read in which the kernel's second ask comes (it comes at once)


class FailedReads:
    """The reads of each process and file that failed within the last ``WINDOW`` seconds (see the module
    docstring). ``caller()`` names the process whose request the calling thread serves (libfuse's
    ``fuse_get_context``)."""

    def __init__(self, caller: Callable[[], int], window: float = WINDOW) -> None:
        self.window = window
        self._caller = caller
        self._failed: dict[tuple[int, object], list[tuple[int, int, float]]] = {}  # (pid, file) -> [(lo, hi, at)]
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._failed)  # unlocked: read on every read, and a stale answer only costs a look

    def add(self, file: object, offset: int, size: int) -> None:
        """A read of ``size`` bytes of ``file`` (its handle or path) at ``offset`` failed with EIO."""
        now = time.monotonic()
        with self._lock:
            self._forget_old(now)
            self._failed.setdefault((self._caller(), file), []).append((offset, offset + max(size, 1), now))

    def asked_again(self, file: object, offset: int) -> bool:
        """Whether a read of ``file`` at ``offset`` is the kernel's second ask for a read that just failed (it
        fails at once, and the process's failures of ``file`` are forgotten)."""
        now = time.monotonic()
        with self._lock:
            self._forget_old(now)
            key = (self._caller(), file)
            if any(lo <= offset < hi for lo, hi, _ in self._failed.get(key, ())):
                del self._failed[key]
                return True
        return False

    def _forget_old(self, now: float) -> None:
        for key in [key for key, reads in self._failed.items() if now - reads[-1][2] > self.window]:
            del self._failed[key]
