"""Files made from a whole tensor (``stats/``, ``png/``): its bytes read in bounded chunks, and the finished files.

A ``nodes.Summary`` segment is made on its first read by a function of a ``TensorBytes`` (``tensor_stats``,
``heatmap``), through ``FINISHED``:

* one computation at a time, on one worker thread: the daemon's memory grows by one computation's chunks
  (bounded, whatever the tensor's size) plus the finished files kept, however many readers ask at once,
  and the buffers it frees stay in one malloc arena for the next;
* single flight: readers of a file being made wait for that computation, and share its result or its
  failure;
* finished files are kept in an LRU bounded in bytes (``FINISHED_BYTES``); a failed one (the source changed,
  a remote read timed out) is not kept, so the next read tries again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from cachetools import LRUCache

from .chunks import TensorBytes

FINISHED_BYTES = 16 << 20  # finished files kept: a few 1024 x 1024 heatmaps (3 MiB each), thousands of stats


class Made(Protocol):
    """What a file made from a tensor is kept by (a ``nodes.Summary``): hashable, its size promised."""

    @property
    def size(self) -> int: ...

    def __hash__(self) -> int: ...


Make = Callable[[TensorBytes, int], bytes]  # (the tensor, the file's size) -> the file, exactly that size


class Finished:
    """Finished summary files by segment: made once each (single flight, one at a time), kept in a bounded LRU."""

    def __init__(self, max_bytes: int = FINISHED_BYTES) -> None:
        self._files: LRUCache[Made, bytes] = LRUCache(maxsize=max_bytes, getsizeof=len)
        self._running: dict[Made, Future[bytes]] = {}
        self._lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None

    def bytes_of(self, segment: Made, make: Make, tensor: TensorBytes) -> bytes:
        """The file of ``segment``, made by ``make`` unless kept or being made; raises what making it raised."""
        with self._lock:
            found = self._files.get(segment)
            if found is not None:
                return found
            running = self._running.get(segment)
            if running is None:
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(1, thread_name_prefix="stfs-summary")
                running = self._running[segment] = self._worker.submit(self._make, segment, make, tensor)
        # The caller waits: with one serving thread (a local mount's default, whose LocalFiles then takes no
        # lock) the source is still read by one thread at a time.
        return running.result()

    def _make(self, segment: Made, make: Make, tensor: TensorBytes) -> bytes:
        try:
            data = make(tensor, segment.size)
            if len(data) != segment.size:  # the size stat gave is a promise
                raise RuntimeError(f"{tensor.key}: {len(data)} bytes made for a file of {segment.size}")
            with self._lock:
                if len(data) <= self._files.maxsize:
                    self._files[segment] = data
            return data
        finally:
            with self._lock:
                del self._running[segment]

    def clear(self) -> None:
        with self._lock:
            self._files.clear()


FINISHED = Finished()
