"""Remote files (HTTP, S3, the Hub) as a byte source: ranged GETs into a memfd block cache, readahead, splice.

Headers and first reads go through obstore (Rust ``object_store``: its requests release the GIL, and it
brings pooling and S3 signing); tensor bytes through the transport's client where it has one (``http.client``
reading the socket straight into the cache, ``stfs.sources.http_client``: HTTP(S), the Hub's CDN, S3 through
URLs obstore presigns), else (an S3 object pinned by its VersionId) obstore too.

* **Pinning**: the first look at a file (one speculative GET of its first ``first_read`` bytes, which
  also holds most headers) pins its size and version (ETag, S3 VersionId; a Hub file is pinned by
  its commit in the URL as well). Every later GET sends ``If-Match`` (or asks for the version): a
  changed object gives ``SourceChanged`` (EIO), never new bytes.
* **Blocks**: a file is cut into ``block_size`` blocks at fixed offsets, each fetched into a slot of the
  block cache (``stfs.sources.block_cache``: one memfd, fixed slots, reused), clipped to the span being
  read (a tensor) unless its reader reads the file in order. With a ``DiskCache``, a fetch takes what the disk
  holds of its range and asks the server for the gaps only; what it fetched goes to disk too, off the read path.
  Replies are spliced from the memfd (``splice_into``) or copied from it (``read_into``). Concurrent reads
  of one block share one fetch. With a reader of its own given (``share_blocks``: stfs._native), the bytes a
  read found in a slot, clipped to its span, are published to it, and it answers the next reads there itself.
* **Readahead**: readers are followed by where they are in the file (within the kernel's reordering: a
  little back, up to 16 MiB forward), not by the span they read. One that starts a span at its first byte
  gets a window of blocks fetched in parallel ahead of it, doubling up to ``max_window``, within the span;
  once it goes on into the next span, the window runs on across spans. A reader that lands inside a span
  (or in a header) gets exactly the bytes it asks for until it has read on a while (``stfs.sources.streams``
  follows the readers, ``_read_ahead`` fetches ahead of them).
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
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import Any, TypeVar, cast

from .. import stopping
from ..threads import name_os_thread
from . import retries
from .base import DEFAULT_CACHE_SIZE, DEFAULT_TIMEOUT, FileInfo, Kind, SharedBlocks, SourceChanged
from .block_cache import PASSED_SCAN, Slot, SlotCache
from .disk_cache import DiskCache, gaps
from .failures import RETRY, UNREACHABLE, refused
from .streams import BACKWARD_SLACK, FIRST_WINDOW, Stream, fetch_ahead, follow
from .transport import (
    READ_AT_MOUNT,
    DeadlineSpent,
    NoRange,
    Pin,
    RangeIgnored,
    Transport,
    kind_of,
    one_line,
    pipe_empty,
    splice_some,
    write_some,
)
from .whole import CHUNK, DiskStore, MemoryStore, WholeFile, fits_in_memory, memory_needed, notice, refusal

log = logging.getLogger(__name__)

MIB = 1 << 20
DEFAULT_BLOCK_SIZE = 8 * MIB
FIRST_READ = 100_000  # the Hub's own metadata reader asks for this much: most headers fit
MAX_WINDOW_BYTES = 64 * MIB  # fetched ahead at most (into the cache's slots): 8 GETs in flight hide 20 ms each
PREFAULT_EXTRA = 4  # slots faulted in at mount: twice the window and these (a reader's own, lent to pipes...)
SMALLEST_GET = 256 << 10  # through obstore, the smallest GET on a slow link, and the least that tells a rate
BRIDGE = 256 << 10  # gaps in what the disk cache holds closer than this are fetched in one request
KEEP_WAIT = 10.0  # seconds a closing source waits for the pieces it is writing to the disk cache
WORKERS = 16

T = TypeVar("T")


Part = bytes | tuple[Slot, int, int]  # bytes of the first read, or (a used slot, where in the memfd, how many)


class RemoteFiles:
    """A ``ByteSource`` over one remote store (see the module docstring).

    ``ranges_required`` (a mount): a file whose server ignores Range (answers 200 with the whole object) is read
    whole, once, into the cache (``stfs.sources.whole``; ``warnings`` says so), or refused with ``RangeIgnored``
    where it cannot fit; without it (``stfs info``, ``stfs check``) the bytes needed are streamed from the start of
    the body and the connection dropped after them.
    ``prefault`` (a mount): the block cache is made at once and the slots a sequential reader cycles through are
    faulted in, in the background (``SlotCache.populate``), so its first reads pay no fresh pages.
    """

    first_read = FIRST_READ
    remote = True
    concurrency = WORKERS  # headers of many shards are read in parallel

    def __init__(
        self,
        transport: Transport,
        cache_size: int = DEFAULT_CACHE_SIZE,
        timeout: float = DEFAULT_TIMEOUT,
        block_size: int = DEFAULT_BLOCK_SIZE,
        disk_cache: DiskCache | None = None,
        ranges_required: bool = False,
        prefault: bool = False,
    ) -> None:
        self.transport = transport
        self.timeout = timeout
        # A slot larger than a 32nd of the cache would leave too few for the readers and the window at once.
        self.block_size = max(256 * 1024, min(block_size, cache_size // 32))
        self.disk_cache = disk_cache
        self.ranges_required = ranges_required
        self._store: Any = None
        self._lock = threading.Lock()
        self._pins: dict[str, Pin] = {}
        self._pinning: dict[str, threading.Lock] = {}
        self._cache: SlotCache | None = None  # made on the first data read: info and check never map it
        self._cache_size = cache_size
        # The window is fetched into slots: at most a quarter of them, so readers always find free ones.
        slots = max(4, cache_size // self.block_size)
        self.max_window = max(FIRST_WINDOW, min(MAX_WINDOW_BYTES // self.block_size, slots // 4))
        self._fetching: dict[tuple[str, int, int, int], Future] = {}
        self._until: dict[tuple[str, int, int, int], retries.Deadline] = {}  # a fetch's: its readers' latest
        self._streams: dict[str, list[Stream]] = {}  # key -> its readers, most recent last (``streams``)
        self._lent: dict[int, list[tuple[Slot, Any]]] = {}  # pipe -> the slots whose pages it holds
        self._pool: ThreadPoolExecutor | None = None
        self._keep_pool: ThreadPoolExecutor | None = None
        self._keeping = 0  # fetched ranges waiting to be written to the disk cache
        self._shared: SharedBlocks | None = None
        self._closed = False
        self.requests = 0
        self.bytes_fetched = 0
        self._arrived = 0  # pieces of bodies arrived: how a waiting reader sees a slow link move
        self._get_rate = float("inf")  # bytes/s one obstore GET brought last: sizes the next (_get_pieces)
        self.ignores_range = False
        self._wholes: dict[str, WholeFile] = {}  # files of a server that ignores Range, read whole (a mount)
        self.warnings: list[str] = []  # for the mount to show: the files it reads whole
        self._nearby = retries.is_loopback(getattr(transport, "endpoint", None) or transport.base)  # this machine
        if prefault:  # a mount: the transport prepared and the first slots faulted in while headers are read
            threading.Thread(target=self._prefault, name="stfs-prefault", daemon=True).start()

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
            raise OSError("this kind of server cannot list a folder; name a .safetensors file or an index")
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
        view = buffer.cast("B") if buffer.format != "B" else buffer
        done = 0
        for part in self._parts(key, offset, len(view), span):
            if isinstance(part, bytes):
                view[done : done + len(part)] = part
                done += len(part)
                continue
            slot, start, length = part
            cache = self._block_cache()
            try:
                view[done : done + length] = cache.view[start : start + length]
            finally:
                with self._lock:
                    cache.release(slot)
            done += length
        return done

    def splice_into(self, key: str, offset: int, count: int, pipe: int, span: tuple[int, int] | None = None) -> int:
        """Move ``count`` bytes of ``key`` at ``offset`` into the non-blocking ``pipe`` from the block cache's memfd
        (``splice``: the pipe holds the slot's pages, lent until this thread's next reply); the count moved, short
        only when the pipe is full."""
        self._give_back(pipe)
        moved = 0
        for part in self._parts(key, offset, count, span):
            if isinstance(part, bytes):  # bytes of the first read (a small file, a tensor beside the header)
                sent = write_some(pipe, part)
            else:
                slot, start, length = part
                cache = self._block_cache()
                sent = 0
                try:
                    sent = splice_some(cache.fd, start, length, pipe)
                finally:
                    with self._lock:
                        if sent:
                            cache.lend(slot)
                            self._lent.setdefault(pipe, []).append((slot, slot.owner))
                        cache.release(slot)
            moved += sent
            if sent < (len(part) if isinstance(part, bytes) else part[2]):
                break
        return moved

    def share_blocks(self, shared: SharedBlocks) -> tuple[int, int, int]:
        """Publish to ``shared`` the bytes that reads find in the block cache (see ``SharedBlocks``); the cache's
        memfd, slot size and slot count, where ``shared`` reads them."""
        cache = self._block_cache()
        with self._lock:
            cache.shared = self._shared = shared
        return cache.fd, cache.slot_size, cache.count

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
                log.warning("cannot check %s: %s", pin.key, one_line(exc))
                continue
            if not same:
                changed.append(pin.key)
        return sorted(changed)

    def listed_sha256(self, key: str) -> str | None:
        return self.transport.sha256(key)

    def close(self) -> None:
        """Stop fetching: queued fetches are dropped, running ones end by themselves (each has a timeout)."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._keep_pool is not None:  # what was fetched is kept: a mount after this one finds it
            self._keep_pool.shutdown(wait=False)
            deadline = time.monotonic() + KEEP_WAIT
            while self._keeping and time.monotonic() < deadline:
                time.sleep(0.01)

    def transfer(self) -> dict[str, int]:
        """What went over the wire so far: requests (a HEAD counts) and body bytes."""
        with self._lock:
            return {"requests": self.requests + self.transport.lookups(), "bytes": self.bytes_fetched}

    def _list(self, folder: str) -> list[str] | None:
        """The store's listing of ``folder`` (retried as a first contact is), or ``None`` if it cannot list."""
        deadline = time.monotonic() + self.timeout
        return self._retrying(lambda: self.transport.list(self._get_store(), folder.rstrip("/") + "/"), None, deadline)

    # -- pinning -------------------------------------------------------------------------------------------------

    def _pin(self, key: str) -> Pin:
        pin = self._pins.get(key)
        if pin is not None:
            return pin
        with self._lock:
            pinning = self._pinning.setdefault(key, threading.Lock())
        with pinning:  # one first read per file, whoever asks first
            pin = self._pins.get(key)
            if pin is None:
                pin = self._from_listing(key) or self._probe(key)
                if self.ranges_required and self.ignores_range and pin.size > len(pin.head):
                    self._read_whole(pin, at_mount=True)
                with self._lock:
                    self._pins[key] = pin
            return pin

    def _from_listing(self, key: str) -> Pin | None:
        """A pin made from the store's listing, without a request, for a file the mount may never read."""
        if key.endswith(READ_AT_MOUNT):
            return None
        listed = self.transport.describe(key)
        if listed is None or listed.kind is not Kind.FILE or listed.size is None:
            return None
        return Pin(key, listed.size, listed.etag, None, listed.mtime_ns, b"", listed.tag)

    def _probe(self, key: str) -> Pin:
        """The speculative first read: the first ``first_read`` bytes, and with them size and version."""
        import obstore

        path = self.transport.store_path(key)
        deadline = time.monotonic() + self.timeout

        def probe() -> tuple[Any, bytes]:
            started = time.monotonic()
            result = obstore.get(self._get_store(), path, options={"range": (0, self.first_read)})
            head = bytes(result.bytes())
            if len(head) >= self.first_read:  # a whole first read: the link's rate, as far as one GET tells
                self._get_rate = min(self._get_rate, len(head) / max(time.monotonic() - started, 1e-6))
            return result.meta, head

        try:
            if self.ignores_range:  # known from another file of this server: do not ask for a range again
                raise NoRange(path)
            meta, head = self._retrying(probe, None, deadline)
        except NoRange:
            # An empty object has no byte to ask for (nginx answers 200, S3 416); else the server ignores Range.
            meta, head = self._retrying(lambda: self._stream(path, 0, self.first_read), None, deadline)
        last_modified = meta.get("last_modified")
        mtime_ns = int(last_modified.timestamp() * 1e9) if last_modified is not None else 0
        return Pin(key, int(meta["size"]), meta.get("e_tag"), meta.get("version"), mtime_ns, head)

    def _stream(self, path: str, lo: int, hi: int, pin: Pin | None = None) -> tuple[Any, bytes]:
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
        if not self.ignores_range:
            if not self.ranges_required:  # a mount reads each file whole, and says so (``_read_whole``)
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

    def _parts(self, key: str, offset: int, count: int, span: tuple[int, int] | None) -> Iterator[Part]:
        """Where ``count`` bytes of ``key`` from ``offset`` are, in order: ``bytes`` of the first read, or a slot of
        the block cache (fetched now if need be), counted as used until the caller releases it."""
        pin = self._pin(key)
        if pin.changed:
            raise SourceChanged(f"{key} has changed since it was mounted")
        low, high = span if span is not None else (0, pin.size)
        count = min(count, pin.size - offset)
        if count <= 0:
            return
        if offset + count <= len(pin.head):  # a header, a small file: the first read has it
            yield pin.head[offset : offset + count]
            return
        deadline = time.monotonic() + self.timeout
        cache = self._block_cache()
        whole = self._whole(pin)
        clip = None if whole is not None else self._read_ahead(pin, offset, count, low, high, deadline)
        end = offset + count
        position = offset
        while position < end:
            if position < len(pin.head):  # the first read's bytes are never fetched again
                take = min(end, len(pin.head))
                yield pin.head[position:take]
                position = take
                continue
            block = position // self.block_size
            stop = min(end, (block + 1) * self.block_size)
            if whole is not None:
                piece = self._whole_piece(pin, whole, block, position, stop, deadline)
            else:
                piece = self._piece(pin, block, position, stop, clip, deadline)
            if isinstance(piece, bytes):
                yield piece
                position += len(piece)
                continue
            slot, lo, hi = piece
            if self._shared is not None and max(lo, low) < min(hi, high):
                with self._lock:
                    self._shared.publish(slot.index, pin.key, block, max(lo, low), min(hi, high))
            take = min(end, hi) - position
            yield slot, cache.offset(slot, block, position), take
            position += take

    def _piece(
        self, pin: Pin, block: int, start: int, end: int, clip: tuple[int, int] | None, deadline: float
    ) -> tuple[Slot, int, int] | bytes:
        """The slot holding byte ``start`` of ``block`` (used: release it) and the range filled there; fetched now
        if need be: the block within ``clip``, or just ``[start, end)`` when ``clip`` is ``None`` (a jump). With
        every slot in use (lent to pipes, being filled): the bytes ``[start, end)``, fetched past the cache."""
        owner = (pin.key, block)
        cache = self._block_cache()
        while True:
            with self._lock:
                found = cache.use(owner, start)
                if found is not None:
                    return found
                future = self._in_flight(pin.key, block, start, deadline)
                if future is None:
                    lo, hi = self._bounds(pin, block, clip) if clip is not None else (start, end)
                    if not lo <= start < hi:
                        lo, hi = start, end
                    lo, hi = self._gap(pin.key, block, lo, hi, start)
                    future = self._submit(pin, block, lo, hi, deadline)
            if future is None:
                into = memoryview(bytearray(end - start))
                self._fill(pin, start, into, deadline)
                return bytes(into)
            self._wait(future, deadline)  # then look again: a fetch ends with its range filled

    # -- files read whole (a server that ignores Range) ------------------------------------------------------------

    def _whole(self, pin: Pin) -> WholeFile | None:
        """The store of ``pin``'s file if a mount reads it whole (its server ignores Range), else ``None``."""
        whole = self._wholes.get(pin.key)
        if whole is None and self.ranges_required and self.ignores_range and pin.size > len(pin.head):
            whole = self._read_whole(pin, at_mount=False)  # pinned from a listing, then found to ignore Range
        return whole

    def _read_whole(self, pin: Pin, at_mount: bool) -> WholeFile:
        """Make the store of a file read whole: in the disk cache given one, else in the block cache's slots held for
        the mount; ``RangeIgnored`` in one line naming the option that would make it fit where it does not. The
        warning goes to ``warnings`` at mount, else to the log."""
        with self._lock:
            known = self._wholes.get(pin.key)
            sizes = [whole.size for whole in self._wholes.values()] + [pin.size]
        if known is not None:
            return known
        store: MemoryStore | DiskStore
        if self.disk_cache is not None:
            limit = self.disk_cache.max_bytes
            if sum(sizes) > limit:
                raise RangeIgnored(refusal(pin.size, "--cache-dir-size", limit, sum(sizes)))
            store = DiskStore(self.disk_cache, pin.key, pin.tag, pin.size)
        else:
            cache = self._block_cache()
            if not fits_in_memory(sizes, cache):
                needed = memory_needed(sizes)
                raise RangeIgnored(refusal(pin.size, "--cache-size", self._cache_size, needed, ", or --cache-dir DIR"))
            store = MemoryStore(cache, self._lock, pin.key, pin.size)
        whole = WholeFile(pin.key, pin.size, store)
        with self._lock:
            self._wholes[pin.key] = whole
        message = f"{pin.key}: {notice(pin.size, self.disk_cache.folder if self.disk_cache else None)}"
        if at_mount:
            self.warnings.append(message)
        else:
            log.warning("%s", message)
        return whole

    def _whole_piece(
        self, pin: Pin, whole: WholeFile, block: int, start: int, end: int, deadline: float
    ) -> tuple[Slot, int, int] | bytes:
        """Bytes of a file read whole from ``start`` (up to ``end``, in ``block``) once they have arrived (the GET
        started if none runs): from its slot (used: release it), or read from its file in the disk cache."""
        if whole.arrived <= start:
            if whole.begin():
                threading.Thread(target=self._get_whole, args=(pin, whole), name="stfs-whole", daemon=True).start()
            whole.wait(start, deadline, self.timeout)
        if isinstance(whole.store, DiskStore):
            return whole.store.read(start, min(end, whole.arrived))
        with self._lock:
            found = self._block_cache().use((pin.key, block), start)
        if found is None:  # the slots are held for the mount: never
            raise OSError(f"byte {start} of {pin.key} arrived but is not in the block cache")
        return found

    def _get_whole(self, pin: Pin, whole: WholeFile) -> None:
        """Read the whole file into its store (a thread of its own): one GET, retried as any request; after a GET
        that broke off, another, the bytes already held skipped, for as long as bytes keep coming."""
        error: BaseException | None = None
        try:
            while not whole.done:
                before = whole.arrived
                try:
                    self._retrying(partial(self._get_body, pin, whole), pin, time.monotonic() + self.timeout)
                except (SourceChanged, FileNotFoundError, RangeIgnored):
                    raise
                except OSError:
                    if whole.arrived == before:  # nothing came since the last GET: the server is not answering
                        raise
            whole.store.finish()
        except BaseException as exc:  # the readers waiting hear of it; the next read asks again
            error = exc
            log.warning("reading the whole of %s failed: %s", pin.key, one_line(exc))
        finally:
            whole.ended(error)

    def _get_body(self, pin: Pin, whole: WholeFile) -> None:
        """One GET of the whole file (``If-Match`` its ETag, or its S3 VersionId), its body from where ``whole``
        has it on written to its store; the connection is dropped when the mount goes away."""
        import obstore

        options: Any = {}
        if pin.version:
            options["version"] = pin.version
        elif pin.etag:
            options["if_match"] = pin.etag
        result = obstore.get(self._get_store(), self.transport.store_path(pin.key), options=options)
        if int(result.meta["size"]) != pin.size:
            self._changed(pin, f"its size is now {result.meta['size']}")
        held, position = whole.arrived, 0
        stream = result.stream(min_chunk_size=CHUNK)
        try:
            for chunk in stream:
                if self._closed:
                    raise OSError("the mount is going away")
                data = memoryview(chunk)
                skip = max(0, min(len(data), held - position))  # bytes a GET before this one brought
                if skip < len(data):
                    whole.store.write(position + skip, data[skip:])
                    whole.wrote(len(data) - skip)
                position += len(data)
                with self._lock:
                    self.bytes_fetched += len(data)
                self._moving(len(data))
        finally:
            del stream, result  # closes the connection
        if position < pin.size:
            raise OSError(f"the connection closed after {position} of {pin.size} bytes")

    def _bounds(self, pin: Pin, block: int, clip: tuple[int, int]) -> tuple[int, int]:
        """The bytes of ``block`` a fetch asks for: the block within ``clip``, never the first read's bytes."""
        lo = max(block * self.block_size, clip[0], len(pin.head))
        return lo, min((block + 1) * self.block_size, clip[1], pin.size)

    def _submit(self, pin: Pin, block: int, lo: int, hi: int, deadline: float) -> Future | None:
        """Start fetching ``[lo, hi)`` of ``block`` into its slot, retried until ``deadline`` (that of the read it is
        for, or the latest of the reads that wait for it); the lock is held. ``None``: no slot is free."""
        fetch_key = (pin.key, block, lo, hi)
        future = self._fetching.get(fetch_key)
        if future is not None:
            self._until[fetch_key].extend(deadline)
        else:
            slot = self._block_cache().acquire((pin.key, block))
            if slot is None:
                return None
            until = self._until[fetch_key] = retries.Deadline(deadline)
            future = self._fetching[fetch_key] = self._executor().submit(self._fetch, pin, block, lo, hi, slot, until)
        return future

    def _fetch(self, pin: Pin, block: int, lo: int, hi: int, slot: Slot, deadline: retries.Deadline) -> None:
        """Fill ``[lo, hi)`` of ``block``'s slot (``_fill``); what came from the server goes on to the disk cache
        after the readers waiting for it have it (``_keep``), the slot held for it meanwhile."""
        cache = self._block_cache()
        try:
            start = cache.offset(slot, block, lo)
            fetched = self._fill(pin, lo, cache.view[start : start + hi - lo], deadline)
            with self._lock:
                cache.filled(slot, lo, hi)
                if fetched and self.disk_cache is not None and not self._closed:
                    cache.hold(slot)
                    self._keeping += 1
                    self._keeper().submit(self._keep, pin, block, slot, fetched)
        finally:
            with self._lock:
                cache.release(slot)
                self._fetching.pop((pin.key, block, lo, hi), None)
                self._until.pop((pin.key, block, lo, hi), None)

    def _fill(
        self, pin: Pin, lo: int, into: memoryview, deadline: float | retries.Deadline | None = None
    ) -> list[tuple[int, int]]:
        """Fill ``into`` with the pinned version's bytes from ``lo``: what the disk cache holds of them from there,
        the gaps from the server (gaps closer than ``BRIDGE`` as one request), until ``deadline`` (a read's, else
        ``--timeout`` from now); the ranges fetched."""
        kept = self.disk_cache.read_into(pin.key, pin.tag, lo, into) if self.disk_cache is not None else []
        missing = gaps(lo, lo + len(into), kept, BRIDGE)
        deadline = time.monotonic() + self.timeout if deadline is None else deadline
        for a, b in missing:
            self._retrying(partial(self._get_into, pin, a, into[a - lo : b - lo]), pin, deadline)
        return missing

    def _keep(self, pin: Pin, block: int, slot: Slot, ranges: list[tuple[int, int]]) -> None:
        """Write the ranges of ``block`` fetched into ``slot`` (held for this) to the disk cache, then let it go."""
        cache = self._block_cache()
        try:
            for lo, hi in ranges:
                if self.disk_cache is not None:
                    start = cache.offset(slot, block, lo)
                    self.disk_cache.put(pin.key, pin.tag, lo, hi, cache.view[start : start + hi - lo])
        finally:
            with self._lock:
                cache.release(slot)
                self._keeping -= 1

    def _keeper(self) -> ThreadPoolExecutor:
        """The one thread that writes to the disk cache (the lock is held): off the read path, one piece at a
        time."""
        if self._keep_pool is None:
            self._keep_pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="stfs-keep", initializer=name_os_thread, initargs=("stfs-keep",)
            )
        return self._keep_pool

    def _get_into(self, pin: Pin, lo: int, into: memoryview) -> memoryview:
        """Fill ``into`` with the pinned version's bytes from ``lo``: read straight into it where the transport has
        a client for that (``Transport.client``), else one ranged GET through obstore, copied."""
        client = self.transport.client()
        if client is None or pin.version:
            self._get_pieces(pin, lo, into)
            return into
        try:
            client.get_into(self.transport.path(pin.key), lo, into, pin.etag, self._moving)
        except Exception as exc:
            if kind_of(exc) != "no-range" or self.ranges_required:
                raise
            into[:] = self._get_range(pin, lo, lo + len(into))  # streams from the start, as obstore's path does
        return into

    def _get_pieces(self, pin: Pin, lo: int, into: memoryview) -> None:
        """Fill ``into`` through obstore in ranged GETs each sized to come within a quarter of ``--timeout`` at the
        rate the last one came: obstore's timeout is a whole request's, and one GET of a block over a slow link would
        time out while its bytes still came. Each GET counts as bytes arriving for the readers waiting on them."""
        done = 0
        while done < len(into):
            size = len(into) - done
            budget = self._get_rate * self.timeout / 4  # bytes one GET brings in a quarter of --timeout (inf: unknown)
            if budget < size:
                size = min(size, max(SMALLEST_GET, int(budget)))
            started = time.monotonic()
            try:
                into[done : done + size] = self._get_range(pin, lo + done, lo + done + size)
            except Exception:
                if time.monotonic() - started >= self.timeout / 2:  # a timeout, likely: smaller GETs on the retry
                    self._get_rate = min(self._get_rate, size / (2 * self.timeout))
                raise
            if size >= SMALLEST_GET:  # a smaller one (a jump's few bytes) is its round trip, not the link's rate
                self._get_rate = size / max(time.monotonic() - started, 1e-6)
            self._moving(size)
            done += size
            if done < len(into):
                with self._lock:
                    self.requests += 1  # what went over the wire: _call counted the first GET only

    def _get_range(self, pin: Pin, lo: int, hi: int) -> memoryview:
        """One ranged GET of the pinned version (``If-Match`` its ETag, or its S3 VersionId)."""
        import obstore

        options: Any = {"range": (lo, hi)}
        if pin.version:
            options["version"] = pin.version
        elif pin.etag:
            options["if_match"] = pin.etag
        path = self.transport.store_path(pin.key)
        try:
            own = self.transport.read_range(pin.key, lo, hi)
            # obstore's Bytes, not a copy: a memoryview of the buffer Rust filled
            data = own if own is not None else memoryview(obstore.get(self._get_store(), path, options=options).bytes())
        except Exception as exc:
            if kind_of(exc) != "no-range" or self.ranges_required:
                raise
            data = memoryview(self._stream(path, lo, hi, pin)[1])
        if len(data) != hi - lo:
            raise OSError(f"asked for bytes {lo}-{hi}, got {len(data)}")
        return data

    def _retrying(self, call: Callable[[], T], pin: Pin | None, until: float | retries.Deadline) -> T:
        """``call()`` again after resets, timeouts, 5xx and 429, with backoff, until ``until`` (a time, or a fetch's
        ``Deadline``, which reads that join it move on); a changed or vanished object (412, 404 of a pinned one) marks
        ``pin`` changed and fails at once. A refused connection to this machine is asked again for ``REFUSED_NEARBY``
        seconds only: nothing will listen there soon."""
        waits = retries.delays()
        delay = next(waits)
        started = time.monotonic()
        attempts = 0
        while True:
            attempts += 1
            if self._closed:
                raise OSError("the mount is going away")
            try:
                return self._call(call)
            except Exception as exc:
                kind = kind_of(exc)
                if pin is not None and kind in ("changed", "gone"):
                    self._changed(pin, one_line(exc))
                if kind == "gone":
                    raise FileNotFoundError(one_line(exc)) from exc
                if kind == "no-range":
                    if pin is None:
                        raise NoRange(one_line(exc)) from exc
                    raise RangeIgnored("the server no longer answers Range requests (it sent the whole file)") from exc
                if kind == UNREACHABLE and pin is None:  # first contact: nothing says a server was ever there
                    raise OSError(one_line(exc)) from exc
                deadline = until.at if isinstance(until, retries.Deadline) else until  # moved on by a read joining
                if kind == UNREACHABLE and self._nearby and refused(exc):
                    deadline = min(deadline, started + retries.REFUSED_NEARBY)
                    if time.monotonic() + delay >= deadline:
                        elapsed = time.monotonic() - started
                        raise OSError(f"{one_line(exc)}, {attempts} times in {elapsed:.1f} s") from exc
                if kind not in (RETRY, UNREACHABLE) or time.monotonic() + delay >= deadline:
                    if kind in (RETRY, UNREACHABLE):
                        message = f"gave up after {self.timeout:g} s: {one_line(exc)}"
                        raise DeadlineSpent(message, deadline) from exc
                    if isinstance(exc, OSError) and not type(exc).__module__.startswith("obstore"):
                        raise
                    raise OSError(one_line(exc)) from exc
                stopping.give_up_if_requested(pin.key if pin else "a first read")  # not --timeout more of retries
                log.debug("retrying %s after %s", pin.key if pin else "a first read", one_line(exc))
                time.sleep(delay)
                delay = next(waits)

    def _changed(self, pin: Pin, detail: str) -> None:
        if not pin.changed:
            pin.changed = True
            if self._shared is not None:
                with self._lock:
                    self._shared.changed(pin.key)
            log.error("%s changed since it was mounted (%s); its reads now fail with EIO", pin.key, detail)
        raise SourceChanged(f"{pin.key} has changed since it was mounted")

    def _call(self, call: Callable[[], T]) -> T:
        self.transport.refuse_if_expired()
        with self._lock:
            self.requests += 1
        try:
            result: Any = call()
        except Exception as exc:
            shown = self.transport.shown(exc)  # no secret of the URL in what is raised, logged or shown
            if shown is exc:
                raise
            raise shown from None
        size = len(result[1]) if isinstance(result, tuple) else len(result) if isinstance(result, memoryview) else 0
        with self._lock:
            self.bytes_fetched += size
        return cast(T, result)

    def _moving(self, count: int) -> None:
        self._arrived += 1  # unlocked: a lost step still leaves the count moved, all a waiting reader asks

    def _wait(self, future: Future, deadline: float) -> None:
        """Wait for ``future`` until ``deadline``, then on for as long as bytes keep arriving (from any of this
        source's fetches, the one awaited perhaps queued behind them): a slow link is not a stalled server. A fetch
        that gave up at its own deadline, before the read's (it began earlier, for another read), is no answer for
        this read: it returns, and the read looks again."""
        while True:
            seen = self._arrived
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
                return
            except DeadlineSpent as exc:
                if exc.deadline >= deadline or time.monotonic() >= deadline:
                    raise
                return
            except FutureTimeout:
                if self._arrived == seen:
                    raise OSError(f"no answer from the server within {self.timeout:g} s") from None
                deadline = time.monotonic() + self.timeout

    def _read_ahead(
        self, pin: Pin, offset: int, count: int, low: int, high: int, deadline: float
    ) -> tuple[int, int] | None:
        """Follow the readers of ``pin``'s file and start fetching ahead of a sequential one; what a read may fetch
        of the blocks it needs: ``(lo, hi)``, or ``None`` for exactly the bytes asked (a jump).

        A reader is keyed by where it is in the file, not by the span (the tensor) it reads: one that starts a
        span at its first byte reads ahead within it, and once it has gone on from one span into the next (a
        loader through ``tensors/`` in file order) its window grows on across spans. A reader that lands inside a
        span (``safe_open``'s ``mmap`` of one tensor through ``files/``) fetches exactly what it asks for, and reads
        ahead within its span only once it has read ``JUMP_PROOF`` bytes on from there."""
        end = offset + count
        cache = self._block_cache()  # made before the lock is taken
        with self._lock:
            stream, followed = follow(self._streams.setdefault(pin.key, []), offset, end, low, high, len(pin.head))
            if followed:
                # blocks before where this read starts are done with; its own (a large read spans several, fetched
                # ahead perhaps) are not until it has them: passed now, a fetch ahead could take their slots first
                behind = (offset - BACKWARD_SLACK) // self.block_size
                for block in range(max(stream.passed, behind - PASSED_SCAN), behind):
                    cache.pass_by((pin.key, block))
                stream.passed = max(stream.passed, behind)
            if not fetch_ahead(stream, self.max_window):
                return None
            clip = (0, pin.size) if stream.crossed else (low, high)
            first = offset // self.block_size
            # a window that with the read's own blocks and those kept behind it would need more slots than the cache
            # has takes the read's blocks before it reads them: fetched twice (a small cache, reads of many blocks)
            own = (end - 1) // self.block_size - first + 1
            room = cache.count - own - -(-BACKWARD_SLACK // self.block_size)
            last = min(-(-clip[1] // self.block_size), (end - 1) // self.block_size + 1 + min(stream.window, room))
            for block in range(first + 1, last):  # the first block is the read's own: it fetches it
                lo, hi = self._bounds(pin, block, clip)
                while lo < hi:  # each part of the block neither held nor on its way
                    gap = self._gap(pin.key, block, lo, hi, lo)
                    if gap[0] < gap[1] and self._submit(pin, block, gap[0], gap[1], deadline) is None:
                        return clip  # no slot free: readers first
                    lo = max(gap[1], lo + 1) if gap[0] < gap[1] else self._covered_until(pin.key, block, lo)
            return clip

    def _held(self, key: str, block: int) -> list[tuple[int, int]]:
        """The ranges of ``block`` filled in its slot or being fetched; the lock is held."""
        ranges = [(lo, hi) for (k, b, lo, hi) in self._fetching if k == key and b == block]
        return ranges + self._block_cache().ranges((key, block))

    def _gap(self, key: str, block: int, lo: int, hi: int, start: int) -> tuple[int, int]:
        """The widest part of ``[lo, hi)`` around ``start`` that is neither held nor being fetched (empty
        ``(start, start)`` if ``start`` is); the lock is held."""
        for a, b in self._held(key, block):
            if a <= start < b:
                return start, start
            if b <= start:
                lo = max(lo, b)
            elif a > start:
                hi = min(hi, a)
        return lo, hi

    def _covered_until(self, key: str, block: int, position: int) -> int:
        """The end of the held range holding ``position``."""
        return max((b for a, b in self._held(key, block) if a <= position < b), default=position + 1)

    def _in_flight(self, key: str, block: int, position: int, deadline: float) -> Future | None:
        """The fetch under way that will fill ``position`` of ``block``, if any, its retries now going on until
        ``deadline`` (the read's that waits for it) at least; the lock is held."""
        for fetch_key, future in self._fetching.items():
            if fetch_key[0] == key and fetch_key[1] == block and fetch_key[2] <= position < fetch_key[3]:
                self._until[fetch_key].extend(deadline)
                return future
        return None

    def _give_back(self, pipe: int) -> None:
        """The slots lent to ``pipe`` for its last reply, returned once the pipe is empty: a pipe serves one thread,
        and libfuse sends a thread's reply before it takes the thread's next request (an empty pipe is not enough
        alone: libfuse moves a reply into a pipe of its own before it writes it to the kernel)."""
        lent = self._lent.get(pipe)
        if lent and pipe_empty(pipe):
            cache = self._block_cache()
            with self._lock:
                for slot, owner in lent:
                    cache.give_back(slot, owner)
                lent.clear()

    def _prefault(self) -> None:
        self.transport.prepare()
        self._block_cache().populate(self.max_window * 2 + PREFAULT_EXTRA)

    def _block_cache(self) -> SlotCache:
        if self._cache is None:
            with self._lock:
                if self._cache is None:
                    self._cache = SlotCache(self._cache_size, self.block_size)
        return self._cache

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=WORKERS,
                thread_name_prefix="stfs-fetch",
                initializer=name_os_thread,
                initargs=("stfs-fetch",),
            )
        return self._pool

    def _get_store(self) -> Any:
        if self._store is None:
            with self._lock:
                if self._store is None:
                    self._store = self.transport.make_store()
        return self._store
