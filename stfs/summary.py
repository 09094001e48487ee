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
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from cachetools import LRUCache

from . import stopping
from .formats import TensorEntry, groups
from .nodes import ReadInto, Summary

FINISHED_BYTES = 16 << 20  # finished files kept: a few 1024 x 1024 heatmaps (3 MiB each), thousands of stats
CHUNK_VALUES = 1 << 18  # values read and decoded at once: with NumPy's temporaries, a few MiB


class TensorBytes:
    """A tensor's bytes in its source, read in order in chunks of whole value groups."""

    __slots__ = ("key", "offset", "entry", "read_source")

    def __init__(self, key: str, offset: int, entry: TensorEntry, read_source: ReadInto) -> None:
        self.key = key
        self.offset = offset
        self.entry = entry
        self.read_source = read_source

    @property
    def count(self) -> int:
        """Values in the tensor."""
        return self.entry.parameters

    def chunks(self, values: int = CHUNK_VALUES) -> Iterator[tuple[int, memoryview]]:
        """(index of its first value, its bytes) for each chunk of about ``values`` values, in order; the bytes are
        overwritten by the next chunk. ``OSError`` if the source is short, ``stopping.Stopping`` if the mount is."""
        group_values, group_bytes = groups(self.entry.dtype)
        step = max(1, values // group_values) * group_bytes
        size = self.entry.size
        buffer = memoryview(bytearray(min(step, size)))
        span = (self.offset, self.offset + size)  # a remote source reads ahead within the tensor
        done = 0
        while done < size:
            stopping.give_up_if_requested(self.key)  # a stop must not wait for the rest of a big tensor
            piece = buffer[: min(step, size - done)]
            if self.read_source(self.key, self.offset + done, piece, span) != len(piece):
                raise OSError(f"{self.key}: short read at byte {self.offset + done}")
            yield done // group_bytes * group_values, piece
            done += len(piece)


Make = Callable[[TensorBytes, int], bytes]  # (the tensor, the file's size) -> the file, exactly that size


class Finished:
    """Finished summary files by segment: made once each (single flight, one at a time), kept in a bounded LRU."""

    def __init__(self, max_bytes: int = FINISHED_BYTES) -> None:
        self._files: LRUCache[Summary, bytes] = LRUCache(maxsize=max_bytes, getsizeof=len)
        self._running: dict[Summary, Future[bytes]] = {}
        self._lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None

    def bytes_of(self, segment: Summary, make: Make, read_source: ReadInto) -> bytes:
        """The file of ``segment``, made by ``make`` unless kept or being made; raises what making it raised."""
        with self._lock:
            found = self._files.get(segment)
            if found is not None:
                return found
            running = self._running.get(segment)
            if running is None:
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(1, thread_name_prefix="stfs-summary")
                running = self._running[segment] = self._worker.submit(self._make, segment, make, read_source)
        # The caller waits: with one serving thread (a local mount's default, whose LocalFiles then takes no
        # lock) the source is still read by one thread at a time.
        return running.result()

    def _make(self, segment: Summary, make: Make, read_source: ReadInto) -> bytes:
        try:
            data = make(TensorBytes(segment.key, segment.offset, segment.tensor, read_source), segment.size)
            if len(data) != segment.size:  # the size stat gave is a promise
                raise RuntimeError(f"{segment.key}: {len(data)} bytes made for a file of {segment.size}")
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
