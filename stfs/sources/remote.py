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
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar, cast

from cachetools import LRUCache

from .base import DEFAULT_CACHE_SIZE, DEFAULT_TIMEOUT, FileInfo, Kind, SourceChanged
from .disk_cache import DiskCache
from .failures import FATAL, RETRY, UNREACHABLE, describe, first_line

log = logging.getLogger(__name__)

MIB = 1 << 20
DEFAULT_BLOCK_SIZE = 4 * MIB
FIRST_READ = 100_000  # the Hub's own metadata reader asks for this much: most headers fit
FORWARD_SLACK = 16 * MIB  # the kernel's readahead may skip ahead this far and still be one sequential reader
BACKWARD_SLACK = 1 * MIB
FIRST_WINDOW = 2  # blocks fetched ahead of a reader that has just shown it is sequential
MAX_WINDOW_BYTES = 96 * MIB  # fetched ahead at most: in flight beside the cache, so bounded apart from it
WORKERS = 16

T = TypeVar("T")


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

    def list(self, store: Any, key: str) -> list[str] | None:
        """Keys of every file at or below ``key`` (a file or a folder), sorted; ``None`` if the store cannot list."""
        return None

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


class _Pin:
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


class RemoteFiles:
    """A ``ByteSource`` over one remote store (see the module docstring).

    ``ranges_required``: a server that ignores Range (answers 200 with the whole object) is refused with
    ``RangeIgnored`` (a mount, whose every read would stream the object from its start); without it (``stfs info``,
    ``stfs check``) the bytes needed are streamed from the start of the body and the connection dropped after them.
    """

    first_read = FIRST_READ
    concurrency = WORKERS  # headers of many shards are read in parallel

    def __init__(
        self,
        transport: Transport,
        cache_size: int = DEFAULT_CACHE_SIZE,
        timeout: float = DEFAULT_TIMEOUT,
        block_size: int = DEFAULT_BLOCK_SIZE,
        disk_cache: DiskCache | None = None,
        ranges_required: bool = False,
    ) -> None:
        self.transport = transport
        self.timeout = timeout
        # A piece larger than the whole cache could not be kept at all (cachetools refuses it).
        self.block_size = max(64 * 1024, min(block_size, cache_size // 4))
        # The window is in flight beside the cache, and obstore holds each fetch twice while it assembles it:
        # an eighth of a small cache keeps the daemon within cache + 150 MiB (bench: 256M peaked at 423 MiB with
        # a quarter, 375-391 MiB with an eighth); from 768 MiB up the window is MAX_WINDOW_BYTES either way.
        self.max_window = max(FIRST_WINDOW, min(MAX_WINDOW_BYTES, cache_size // 8) // self.block_size)
        self.disk_cache = disk_cache
        self.ranges_required = ranges_required
        self._store: Any = None
        self._lock = threading.Lock()
        self._pins: dict[str, _Pin] = {}
        self._pinning: dict[str, threading.Lock] = {}
        # (key, block) -> [(lo, hi, data)]: the fetched pieces of one block (a piece is clipped to a span)
        self._blocks: LRUCache = LRUCache(maxsize=cache_size, getsizeof=lambda pieces: sum(len(p[2]) for p in pieces))
        self._fetching: dict[tuple[str, int, int, int], Future] = {}
        self._streams: LRUCache = LRUCache(maxsize=256)  # (key, span start) -> [next offset, window]
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
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
            return Kind.FOLDER if self._list(key) else None

    def walk(self, folder: str) -> list[str]:
        listed = self._list(folder)
        if listed is None:
            raise OSError(f"{folder}: this kind of server cannot list a folder; name a .safetensors file or an index")
        return listed

    def stat(self, key: str) -> FileInfo:
        pin = self._pin(key)
        return FileInfo(key=key, size=pin.size, mtime_ns=pin.mtime_ns, version=pin.tag)

    def read(self, key: str, offset: int, size: int) -> bytes:
        """Bytes for headers and indexes: from the first read where it holds them, the rest in one request."""
        pin = self._pin(key)
        end = min(offset + size, pin.size)
        if end <= offset:
            return b""
        if end <= len(pin.head):
            return pin.head[offset:end]
        known = pin.head[offset:] if offset < len(pin.head) else b""
        start = offset + len(known)
        deadline = time.monotonic() + self.timeout
        return known + bytes(self._retrying(lambda: self._get_range(pin, start, end), pin, deadline))

    def read_into(self, key: str, offset: int, buffer: memoryview, span: tuple[int, int] | None = None) -> int:
        """Fill ``buffer`` with bytes of ``key`` from ``offset``; ``span`` bounds fetches and readahead (a tensor)."""
        pin = self._pin(key)
        if pin.changed:
            raise SourceChanged(f"{key} has changed since it was mounted")
        low, high = span if span is not None else (0, pin.size)
        count = min(len(buffer), pin.size - offset)
        if count <= 0:
            return 0
        view = buffer.cast("B") if buffer.format != "B" else buffer
        if offset + count <= len(pin.head):  # a header, a small file: the first read has it
            view[:count] = pin.head[offset : offset + count]
            return count
        deadline = time.monotonic() + self.timeout
        whole = self._read_ahead(pin, offset, count, low, high)
        done = 0
        while done < count:
            position = offset + done
            if position < len(pin.head):  # the first read's bytes are never fetched again
                take = min(count - done, len(pin.head) - position)
                view[done : done + take] = pin.head[position : position + take]
                done += take
                continue
            block = position // self.block_size
            end = min(offset + count, (block + 1) * self.block_size)
            lo, _, data = self._piece(pin, block, position, end, low, high, whole, deadline)
            take = min(count - done, lo + len(data) - position)
            view[done : done + take] = data[position - lo : position - lo + take]
            done += take
        return done

    def changed(self) -> list[str]:
        """Keys whose object no longer has the pinned version, asked of the server (one request each)."""
        with self._lock:
            pins = list(self._pins.values())
        store = self._get_store()
        changed = []
        for pin in pins:
            if pin.changed:
                changed.append(pin.key)
                continue
            try:
                same = self._call(partial(self.transport.still_there, store, pin.key, pin.etag, pin.version, pin.size))
            except FileNotFoundError:
                same = False
            except Exception as exc:  # cannot ask: say so in the log, count it as unknown (unchanged)
                log.warning("cannot check %s: %s", pin.key, _one_line(exc))
                continue
            if not same:
                changed.append(pin.key)
        return sorted(changed)

    def close(self) -> None:
        """Stop fetching: queued fetches are dropped, running ones end by themselves (each has a timeout)."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def transfer(self) -> dict[str, int]:
        """What went over the wire so far: requests (a HEAD counts) and body bytes."""
        with self._lock:
            return {"requests": self.requests, "bytes": self.bytes_fetched}

    def _list(self, folder: str) -> list[str] | None:
        """The store's listing of ``folder`` (retried as a first contact is), or ``None`` if it cannot list."""
        deadline = time.monotonic() + self.timeout
        return self._retrying(lambda: self.transport.list(self._get_store(), folder.rstrip("/") + "/"), None, deadline)

    # -- pinning -------------------------------------------------------------------------------------------------

    def _pin(self, key: str) -> _Pin:
        pin = self._pins.get(key)
        if pin is not None:
            return pin
        with self._lock:
            pinning = self._pinning.setdefault(key, threading.Lock())
        with pinning:  # one first read per file, whoever asks first
            pin = self._pins.get(key)
            if pin is None:
                pin = self._from_listing(key) or self._probe(key)
                with self._lock:
                    self._pins[key] = pin
            return pin

    def _from_listing(self, key: str) -> _Pin | None:
        """A pin made from the store's listing, without a request, for a file the mount may never read."""
        if key.endswith(READ_AT_MOUNT):
            return None
        listed = self.transport.describe(key)
        if listed is None or listed.kind is not Kind.FILE or listed.size is None:
            return None
        return _Pin(key, listed.size, listed.etag, None, listed.mtime_ns, b"", listed.tag)

    def _probe(self, key: str) -> _Pin:
        """The speculative first read: the first ``first_read`` bytes, and with them size and version."""
        import obstore

        path = self.transport.path(key)
        deadline = time.monotonic() + self.timeout

        def probe() -> tuple[Any, bytes]:
            result = obstore.get(self._get_store(), path, options={"range": (0, self.first_read)})
            return result.meta, bytes(result.bytes())

        try:
            if self.ignores_range:  # known from another file of this server: do not ask for a range again
                raise _NoRange(path)
            meta, head = self._retrying(probe, None, deadline)
        except _NoRange:
            # An empty object has no byte to ask for (nginx answers 200, S3 416); else the server ignores Range.
            meta, head = self._retrying(lambda: self._stream(path, 0, self.first_read), None, deadline)
        last_modified = meta.get("last_modified")
        mtime_ns = int(last_modified.timestamp() * 1e9) if last_modified is not None else 0
        return _Pin(key, int(meta["size"]), meta.get("e_tag"), meta.get("version"), mtime_ns, head)

    def _stream(self, path: str, lo: int, hi: int, pin: _Pin | None = None) -> tuple[Any, bytes]:
        """``[lo, hi)`` of an object whose server ignores Range: its body streamed from the start, the connection
        dropped once ``hi`` is reached (never the whole body), unless a mount needs ranges (``RangeIgnored``)."""
        import obstore

        options: Any = {}
        if pin is not None and pin.version:
            options["version"] = pin.version
        elif pin is not None and pin.etag:
            options["if_match"] = pin.etag
        result = obstore.get(self._get_store(), path, options=options)
        meta = result.meta
        if int(meta["size"]) == 0:
            return meta, b""
        if self.ranges_required:
            raise RangeIgnored(
                "the server ignores Range requests (it answered 200 with the whole file): stfs mount needs them; "
                "stfs info and stfs check work"
            )
        if not self.ignores_range:
            log.warning("the server of %s ignores Range requests: reading from the start of each file", path)
            self.ignores_range = True
        received = bytearray()
        stream = result.stream(min_chunk_size=64 * 1024)
        try:
            for chunk in stream:
                received += chunk
                if len(received) >= hi:
                    break
        finally:
            del stream, result  # closes the connection: the rest of the body is never read
        return meta, bytes(received[lo:hi])

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
        lo, hi = (max(block_lo, low, len(pin.head)), min(block_hi, high)) if whole else (start, end)
        fetch_key = (pin.key, block, lo, hi)
        future = self._fetching.get(fetch_key)
        if future is None:
            future = self._fetching[fetch_key] = self._executor().submit(self._fetch, pin, block, lo, hi)
        return future

    def _fetch(self, pin: _Pin, block: int, lo: int, hi: int) -> tuple[int, int, memoryview]:
        try:
            kept = self.disk_cache.get(pin.key, pin.tag, lo, hi) if self.disk_cache else None
            if kept is not None:
                data = memoryview(kept)
            else:
                data = self._retrying(lambda: self._get_range(pin, lo, hi), pin, time.monotonic() + self.timeout)
                if self.disk_cache is not None:
                    self.disk_cache.put(pin.key, pin.tag, lo, hi, data)
            piece = (lo, hi, data)
            with self._lock:
                pieces = [p for p in self._blocks.get((pin.key, block), ()) if not (lo <= p[0] and p[1] <= hi)]
                self._blocks[(pin.key, block)] = [*pieces, piece]
            return piece
        finally:
            with self._lock:
                self._fetching.pop((pin.key, block, lo, hi), None)

    def _get_range(self, pin: _Pin, lo: int, hi: int) -> memoryview:
        """One ranged GET of the pinned version (``If-Match`` its ETag, or its S3 VersionId)."""
        import obstore

        options: Any = {"range": (lo, hi)}
        if pin.version:
            options["version"] = pin.version
        elif pin.etag:
            options["if_match"] = pin.etag
        path = self.transport.path(pin.key)
        try:
            # obstore's Bytes, not a copy: a memoryview of the buffer Rust filled
            data = memoryview(obstore.get(self._get_store(), path, options=options).bytes())
        except Exception as exc:
            if _kind_of(exc) != "no-range" or self.ranges_required:
                raise
            data = memoryview(self._stream(path, lo, hi, pin)[1])
        if len(data) != hi - lo:
            raise OSError(f"asked for bytes {lo}-{hi}, got {len(data)}")
        return data

    def _retrying(self, call: Callable[[], T], pin: _Pin | None, deadline: float) -> T:
        """``call()`` again after resets, timeouts, 5xx and 429, with backoff, until ``deadline``; a changed or
        vanished object (412, 404 of a pinned one) marks ``pin`` changed and fails at once."""
        delay = 0.05
        while True:
            if self._closed:
                raise OSError("the mount is going away")
            try:
                return self._call(call)
            except Exception as exc:
                kind = _kind_of(exc)
                if pin is not None and kind in ("changed", "gone"):
                    self._changed(pin, _one_line(exc))
                if kind == "gone":
                    raise FileNotFoundError(_one_line(exc)) from exc
                if kind == "no-range":
                    if pin is None:
                        raise _NoRange(_one_line(exc)) from exc
                    raise RangeIgnored("the server no longer answers Range requests (it sent the whole file)") from exc
                if kind == UNREACHABLE and pin is None:  # first contact: nothing says a server was ever there
                    raise OSError(_one_line(exc)) from exc
                if kind not in (RETRY, UNREACHABLE) or time.monotonic() + delay >= deadline:
                    if kind in (RETRY, UNREACHABLE):
                        raise OSError(f"gave up after {self.timeout:g} s: {_one_line(exc)}") from exc
                    if isinstance(exc, OSError) and not type(exc).__module__.startswith("obstore"):
                        raise
                    raise OSError(_one_line(exc)) from exc
                log.debug("retrying %s after %s", pin.key if pin else "a first read", _one_line(exc))
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _changed(self, pin: _Pin, detail: str) -> None:
        if not pin.changed:
            pin.changed = True
            log.error("%s changed since it was mounted (%s); its reads now fail with EIO", pin.key, detail)
        raise SourceChanged(f"{pin.key} has changed since it was mounted")

    def _call(self, call: Callable[[], T]) -> T:
        with self._lock:
            self.requests += 1
        result: Any = call()
        size = len(result[1]) if isinstance(result, tuple) else len(result) if isinstance(result, memoryview) else 0
        with self._lock:
            self.bytes_fetched += size
        return cast(T, result)

    def _wait(self, future: Future, deadline: float) -> tuple[int, int, memoryview]:
        remaining = deadline - time.monotonic()
        try:
            return future.result(timeout=max(0.0, remaining))
        except FutureTimeout:
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
                need = max(low, block * self.block_size, len(pin.head))  # the block's first byte not at hand
                if need < min(high, (block + 1) * self.block_size) and not any(
                    p[0] <= need < p[1] for p in self._blocks.get((pin.key, block), ())
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


class _NoRange(OSError):
    """A Range request answered without a range: an empty object, or a server that ignores Range."""


def _kind_of(exc: BaseException) -> str:
    """How to take a failed request (``failures``): ``gone`` (404), ``changed`` (412: If-Match failed), ``no-range``
    (200 or 416 to a Range request), ``fatal`` (a certificate, another 4xx: asking again will not help),
    ``unreachable`` (refused, no such host), else ``retry`` (resets, timeouts, 5xx, 429)."""
    if isinstance(exc, (RangeIgnored, SourceChanged)):
        return FATAL
    return describe(exc).kind


def _one_line(exc: BaseException) -> str:
    """The cause of a failed request for a person: one line, its source named by the caller."""
    if isinstance(exc, (RangeIgnored, SourceChanged, _NoRange)):
        return first_line(exc)
    return describe(exc).cause
