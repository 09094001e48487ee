"""Remote files (HTTP, S3, the Hub) as a byte source: ranged GETs through obstore, a block cache, readahead.

Every byte comes from an HTTP Range request made by obstore (Rust ``object_store``: its requests
release the GIL for the whole wait, and it brings retries, pooling and S3 signing). On top:

* **Pinning**: the first look at a file (one speculative GET of its first ``first_read`` bytes, which
  also holds most headers) pins its size and version (ETag, S3 VersionId; a Hub file is pinned by
  its commit in the URL as well). Every later GET sends ``If-Match`` (or asks for the version): a
  changed object gives ``SourceChanged`` (EIO), never new bytes.
* **Blocks**: a file is cut into ``block_size`` blocks at fixed offsets. A read fetches only the
  blocks that cover it, each clipped to the span being read (a tensor), so reading a tensor never
  fetches its neighbours' bytes; fetched pieces go to an LRU bounded in bytes (``cache_size``) and,
  with a ``DiskCache``, to disk. Concurrent reads of one block share one fetch.
* **Readahead**: a reader that goes on where it stopped (within the kernel's reordering: a little
  back, up to 16 MiB forward) gets a window of blocks fetched in parallel ahead of it, doubling up to
  ``max_window``; a random reader gets exactly the bytes it asked for.
* **Faults**: every fetch runs on a worker thread and is retried with backoff (resets, timeouts, 5xx,
  429) until ``timeout`` seconds have passed since the read began; then the read fails with EIO.
  The mount stays up and serves again once the server does.

obstore is not fork-safe (its runtime's threads do not survive ``fork``): a ``RemoteFiles`` is made
in the process that uses it, after any fork (``daemon.run_background`` plans in the child).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from cachetools import LRUCache

from .base import FileInfo, Kind, SourceChanged
from .disk_cache import DiskCache

log = logging.getLogger(__name__)

MIB = 1 << 20
DEFAULT_BLOCK_SIZE = 4 * MIB
DEFAULT_CACHE_SIZE = 1 << 30
DEFAULT_TIMEOUT = 30.0
FIRST_READ = 100_000  # the Hub's own metadata reader asks for this much: most headers fit
FORWARD_SLACK = 16 * MIB  # the kernel's readahead may skip ahead this far and still be one sequential reader
BACKWARD_SLACK = 1 * MIB
FIRST_WINDOW = 2  # blocks fetched ahead of a reader that has just shown it is sequential
MAX_WINDOW_BYTES = 96 * MIB  # fetched ahead at most: in flight beside the cache, so bounded apart from it
WORKERS = 16


class RangeIgnored(OSError):
    """The server answered a Range request with the whole object (200): stfs cannot mount from it."""


@dataclass(frozen=True, slots=True)
class Listing:
    """What a remote source can say of a key without reading it: a file, a folder, or nothing."""

    kind: Kind | None
    size: int | None = None


class Transport:
    """One remote store: how a key maps to it, and the calls stfs makes of it (all through obstore).

    Subclasses (``stfs.sources.urls``) give ``make_store`` and, where the store can list, ``list``.
    """

    base: str  # the key prefix this store serves, e.g. "https://host:8080" or "s3://bucket"

    def make_store(self) -> Any:
        raise NotImplementedError

    def path(self, key: str) -> str:
        return key[len(self.base) :].lstrip("/")

    def list(self, key: str) -> list[str] | None:
        """Keys of every file at or below ``key`` (a file or a folder), sorted; ``None`` if the store cannot list."""
        return None

    def describe(self, key: str) -> Listing | None:
        """``kind`` of ``key`` when the store knows it without a request (the Hub's file list); else ``None``."""
        return None


class _Pin:
    __slots__ = ("key", "size", "etag", "version", "head", "changed")

    def __init__(self, key: str, size: int, etag: str | None, version: str | None, head: bytes) -> None:
        self.key = key
        self.size = size
        self.etag = etag
        self.version = version
        self.head = head  # the first bytes, from the speculative first read
        self.changed = False


class RemoteFiles:
    """A ``ByteSource`` over one remote store (see the module docstring)."""

    first_read = FIRST_READ
    concurrency = WORKERS  # headers of many shards are read in parallel

    def __init__(
        self,
        transport: Transport,
        cache_size: int = DEFAULT_CACHE_SIZE,
        timeout: float = DEFAULT_TIMEOUT,
        block_size: int = DEFAULT_BLOCK_SIZE,
        disk_cache: DiskCache | None = None,
    ) -> None:
        self.transport = transport
        self.timeout = timeout
        self.block_size = block_size
        self.max_window = max(FIRST_WINDOW, min(MAX_WINDOW_BYTES, cache_size // 4) // block_size)
        self.disk_cache = disk_cache
        self._store: Any = None
        self._lock = threading.Lock()
        self._pins: dict[str, _Pin] = {}
        # (key, block) -> [(lo, hi, data)]: the fetched pieces of one block (a piece is clipped to a span)
        self._blocks: LRUCache = LRUCache(maxsize=cache_size, getsizeof=lambda pieces: sum(len(p[2]) for p in pieces))
        self._fetching: dict[tuple[str, int, int, int], Future] = {}
        self._streams: LRUCache = LRUCache(maxsize=256)  # (key, span start) -> [next offset, window]
        self._pool: ThreadPoolExecutor | None = None
        self.requests = 0
        self.bytes_fetched = 0
        self.ignores_range = False

    # -- the ByteSource interface ------------------------------------------------------------------------------

    def kind(self, key: str) -> Kind | None:
        known = self.transport.describe(key)
        if known is not None:
            return known.kind
        if key.endswith("/"):
            return Kind.FOLDER
        try:
            self._pin(key)
            return Kind.FILE
        except FileNotFoundError:
            listed = self.transport.list(key.rstrip("/") + "/")
            return Kind.FOLDER if listed else None

    def walk(self, folder: str) -> list[str]:
        listed = self.transport.list(folder.rstrip("/") + "/")
        if listed is None:
            raise OSError(f"{folder}: this kind of server cannot list a folder; name a .safetensors file or an index")
        return listed

    def stat(self, key: str) -> FileInfo:
        pin = self._pin(key)
        return FileInfo(key=key, size=pin.size, mtime_ns=0, version=pin.version or pin.etag or "")

    def read(self, key: str, offset: int, size: int) -> bytes:
        pin = self._pin(key)
        end = min(offset + size, pin.size)
        if end <= len(pin.head):
            return pin.head[offset:end]
        buffer = bytearray(max(0, end - offset))
        self.read_into(key, offset, memoryview(buffer), span=(0, pin.size))
        return bytes(buffer)

    def read_into(self, key: str, offset: int, buffer: memoryview, span: tuple[int, int] | None = None) -> int:
        """Fill ``buffer`` with bytes of ``key`` from ``offset``; ``span`` bounds fetches and readahead (a tensor)."""
        pin = self._pin(key)
        if pin.changed:
            raise SourceChanged(f"{key} has changed since it was mounted")
        low, high = span if span is not None else (0, pin.size)
        count = min(len(buffer), pin.size - offset)
        if count <= 0:
            return 0
        deadline = time.monotonic() + self.timeout
        view = buffer.cast("B") if buffer.format != "B" else buffer
        whole = self._read_ahead(pin, offset, count, low, high)
        done = 0
        while done < count:
            position = offset + done
            block = position // self.block_size
            end = min(offset + count, (block + 1) * self.block_size)
            piece = self._piece(pin, block, position, end, low, high, whole, deadline)
            lo, data = piece[0], piece[2]
            take = min(count - done, lo + len(data) - position)
            view[done : done + take] = data[position - lo : position - lo + take]
            done += take
        return done

    def changed(self) -> list[str]:
        """Keys whose object no longer has the pinned version, asked of the server (one HEAD each)."""
        import obstore

        changed = []
        for key, pin in list(self._pins.items()):
            if pin.changed:
                changed.append(key)
                continue
            try:
                meta = self._call(partial(obstore.head, self._get_store(), self.transport.path(key)))
            except FileNotFoundError:
                changed.append(key)
                continue
            except Exception as exc:  # cannot ask: say so in the log, count it as unknown (unchanged)
                log.warning("cannot check %s: %s", key, exc)
                continue
            if (
                (pin.version and meta.get("version") != pin.version)
                or (pin.etag and meta.get("e_tag") != pin.etag)
                or meta["size"] != pin.size
            ):
                changed.append(key)
        return sorted(changed)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def transfer(self) -> dict[str, int]:
        """What went over the wire so far: requests (a HEAD counts) and body bytes."""
        return {"requests": self.requests, "bytes": self.bytes_fetched}

    # -- pinning -------------------------------------------------------------------------------------------------

    def _pin(self, key: str) -> _Pin:
        pin = self._pins.get(key)
        if pin is not None:
            return pin
        import obstore

        path = self.transport.path(key)

        def probe() -> tuple[Any, bytes]:
            result = obstore.get(self._get_store(), path, options={"range": (0, self.first_read)})
            return result.meta, bytes(result.bytes())

        try:
            meta, head = self._call(probe)
        except FileNotFoundError:
            raise
        except Exception as exc:
            if _is_not_partial(exc):
                meta, head = self._whole_prefix(path)
            elif "416" in str(exc) or "range" in str(exc).lower():  # an empty object has no byte to ask for
                meta, head = self._call(lambda: obstore.head(self._get_store(), path)), b""
            else:
                raise OSError(f"{key}: {_one_line(exc)}") from exc
        pin = _Pin(key, int(meta["size"]), meta.get("e_tag"), meta.get("version"), head)
        with self._lock:
            return self._pins.setdefault(key, pin)

    def _whole_prefix(self, path: str) -> tuple[Any, bytes]:
        """For a server that ignores Range: stream the first bytes of the whole body, then drop the connection."""
        import obstore

        self.ignores_range = True
        result = obstore.get(self._get_store(), path)
        received = bytearray()
        for chunk in result.stream(min_chunk_size=64 * 1024):  # closed when dropped: never the whole body
            received += chunk
            if len(received) >= self.first_read:
                break
        with self._lock:
            self.requests += 1
            self.bytes_fetched += len(received)
        return result.meta, bytes(received[: self.first_read])

    # -- blocks --------------------------------------------------------------------------------------------------

    def _piece(
        self, pin: _Pin, block: int, start: int, end: int, low: int, high: int, whole: bool, deadline: float
    ) -> tuple[int, int, memoryview]:
        """A fetched piece of ``block`` holding byte ``start``; fetched now if need be: the block within
        ``[low, high)`` if ``whole``, else just ``[start, end)``."""
        key = pin.key
        with self._lock:
            for piece in self._blocks.get((key, block), ()):
                if piece[0] <= start < piece[1]:
                    return piece
            # a fetch in flight that will hold it
            future = next(
                (f for (k, b, lo, hi), f in self._fetching.items() if k == key and b == block and lo <= start < hi),
                None,
            )
            if future is None:
                future = self._submit(pin, block, low, high, start, end, whole)
        return self._wait(future, deadline)

    def _submit(self, pin: _Pin, block: int, low: int, high: int, start: int, end: int, whole: bool = True) -> Future:
        """Start fetching ``block`` clipped to ``[low, high)`` (or only ``[start, end)``); the lock is held."""
        block_lo, block_hi = block * self.block_size, min(pin.size, (block + 1) * self.block_size)
        lo, hi = (max(block_lo, low), min(block_hi, high)) if whole else (start, end)
        fetch_key = (pin.key, block, lo, hi)
        future = self._fetching.get(fetch_key)
        if future is None:
            future = self._fetching[fetch_key] = self._executor().submit(self._fetch, pin, block, lo, hi)
        return future

    def _fetch(self, pin: _Pin, block: int, lo: int, hi: int) -> tuple[int, int, memoryview]:
        import obstore

        try:
            kept = self.disk_cache.get(pin.key, pin.version or pin.etag or "", lo, hi) if self.disk_cache else None
            if kept is not None:
                data = memoryview(kept)
            else:
                options: Any = {"range": (lo, hi)}
                if pin.version:
                    options["version"] = pin.version
                elif pin.etag:
                    options["if_match"] = pin.etag
                path = self.transport.path(pin.key)
                # obstore's Bytes, not a copy: a memoryview of the buffer Rust filled
                data = self._retrying(
                    lambda: memoryview(obstore.get(self._get_store(), path, options=options).bytes()), pin
                )
                if len(data) != hi - lo:
                    raise OSError(f"{pin.key}: asked for bytes {lo}-{hi}, got {len(data)}")
                if self.disk_cache is not None:
                    self.disk_cache.put(pin.key, pin.version or pin.etag or "", lo, hi, data)
            piece = (lo, hi, data)
            with self._lock:
                pieces = [p for p in self._blocks.get((pin.key, block), ()) if not (lo <= p[0] and p[1] <= hi)]
                self._blocks[(pin.key, block)] = [*pieces, piece]
            return piece
        finally:
            with self._lock:
                self._fetching.pop((pin.key, block, lo, hi), None)

    def _retrying(self, call: Callable[[], memoryview], pin: _Pin) -> memoryview:
        """``call()`` again after resets, timeouts, 5xx and 429, with backoff, until ``timeout`` has passed."""
        deadline = time.monotonic() + self.timeout
        delay = 0.05
        while True:
            try:
                return self._call(call)
            except Exception as exc:
                if type(exc).__name__ == "PreconditionError" or _is_not_partial(exc):
                    self._changed(pin, _one_line(exc))
                if isinstance(exc, FileNotFoundError):
                    self._changed(pin, "it is gone from the server")
                if time.monotonic() + delay >= deadline:
                    raise OSError(f"{pin.key}: gave up after {self.timeout:g} s: {_one_line(exc)}") from exc
                log.debug("retrying %s after %s", pin.key, _one_line(exc))
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _changed(self, pin: _Pin, detail: str) -> None:
        if not pin.changed:
            pin.changed = True
            log.error("%s changed since it was mounted (%s); its reads now fail with EIO", pin.key, detail)
        raise SourceChanged(f"{pin.key} has changed since it was mounted")

    def _call(self, call: Callable[[], Any]) -> Any:
        with self._lock:
            self.requests += 1
        result = call()
        size = len(result[1]) if isinstance(result, tuple) else len(result) if isinstance(result, memoryview) else 0
        with self._lock:
            self.bytes_fetched += size
        return result

    def _wait(self, future: Future, deadline: float) -> tuple[int, int, memoryview]:
        remaining = deadline - time.monotonic()
        try:
            return future.result(timeout=max(0.0, remaining))
        except TimeoutError:
            raise OSError(f"no answer from the server within {self.timeout:g} s") from None

    def _read_ahead(self, pin: _Pin, offset: int, count: int, low: int, high: int) -> bool:
        """Follow the reader of ``[low, high)``: a sequential one gets a window of blocks fetched ahead of it
        (and ``True``: fetch whole blocks); a random one, ``False``: fetch exactly the bytes asked for."""
        stream_key = (pin.key, low)
        with self._lock:
            stream = self._streams.get(stream_key)
            sequential = offset == low or (
                stream is not None and stream[0] - BACKWARD_SLACK <= offset <= stream[0] + FORWARD_SLACK
            )
            if not sequential:
                self._streams[stream_key] = [offset + count, 0]
                return False
            window = FIRST_WINDOW if stream is None or stream[1] == 0 else min(stream[1] * 2, self.max_window)
            self._streams[stream_key] = [max(offset + count, stream[0] if stream else 0), window]
            first = offset // self.block_size
            last = min(-(-high // self.block_size), (offset + count - 1) // self.block_size + 1 + window)
            for block in range(first, last):
                if not any(
                    p[0] <= max(low, block * self.block_size) < p[1] for p in self._blocks.get((pin.key, block), ())
                ):
                    self._submit(pin, block, low, high, 0, 0)
        return True

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="stfs-fetch")
        return self._pool

    def _get_store(self) -> Any:
        if self._store is None:
            with self._lock:
                if self._store is None:
                    self._store = self.transport.make_store()
        return self._store


def _is_not_partial(exc: Exception) -> bool:
    text = str(exc)
    return "NotPartial" in text or "not partial" in text.lower() or "200 OK" in text and "range" in text.lower()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
