"""Files of a server that ignores Range (``python3 -m http.server``), mounted: each read whole, once, front to back, by
one GET into the cache, and every read of it served from there (SPEC §7, "a server that ignores Range").

Such a server answers a ranged GET with 200 and the whole body, so a mount cannot fetch the blocks a read needs: each
read would stream the file from its start. Instead the first read of a file starts one GET of all of it, whose body
goes into a store as it comes; a read waits only until its own bytes have arrived (a read of the first tensor does not
wait for the last), and no read buffers anything but into the store itself. The stores:

* with ``--cache-dir``: a file in DIR (``DiskStore``), kept there as the object's one piece once complete when the
  server names a version (an ETag), so the next mount reads it from disk; the daemon holds its descriptor, so the
  bytes stay readable even if another daemon sharing DIR evicts the piece meanwhile;
* else the block cache's slots (``MemoryStore``), one a block of the file, held for the life of the mount so they
  are never evicted: within ``--cache-size`` by construction, spliced to the kernel and shared with stfs._native as
  any fetched block is.

Whether a file fits is decided at mount, from its size (the 200's Content-Length): a file that cannot fit is refused
in one line naming the option that would make it fit (``refusal``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

from .failures import first_line

if TYPE_CHECKING:
    from .block_cache import Slot, SlotCache
    from .disk_cache import DiskCache

MIB = 1 << 20
CHUNK = 1 << 20  # the body is taken in pieces of at least this (each copied once, into the store)
MEMORY_RESERVE = 4  # block cache slots left to other reads when files read whole take the rest
LARGE_BLOCK = 8 * MIB  # the block size of a --cache-size of 256 MiB or more (``RemoteFiles.block_size``)


class MemoryStore:
    """The block cache's slots for blocks ``0 … n-1`` of ``key``, held (in use) for the life of the mount.

    ``lock`` is the ``RemoteFiles`` lock, under which the cache is used."""

    def __init__(self, cache: SlotCache, lock: threading.Lock, key: str, size: int) -> None:
        self.cache = cache
        self.lock = lock
        self.key = key
        self.slots: list[Slot] = []
        blocks = -(-size // cache.slot_size)
        with lock:
            for block in range(blocks):
                slot = cache.acquire((key, block))
                if slot is None:  # every slot in use: give back those taken
                    for taken in self.slots:
                        cache.release(taken)
                    raise OSError(f"no room in the block cache for {blocks} blocks")
                self.slots.append(slot)

    def write(self, position: int, data: memoryview) -> None:
        """Bytes ``[position, position + len(data))`` of the file, into their slots."""
        size = self.cache.slot_size
        done = 0
        while done < len(data):
            block, start = divmod(position + done, size)
            count = min(len(data) - done, size - start)
            slot = self.slots[block]
            at = self.cache.offset(slot, block, position + done)
            self.cache.view[at : at + count] = data[done : done + count]
            with self.lock:
                self.cache.filled(slot, position + done, position + done + count)
            done += count

    def finish(self) -> None:
        """All of the file is here (the slots hold it until the mount ends)."""


class DiskStore:
    """A file in the disk cache's folder holding the object from its start, read as it is written; kept as the
    object's piece once complete where it has a version (``DiskCache.keep_piece``)."""

    def __init__(self, disk: DiskCache, key: str, version: str, size: int) -> None:
        self.disk = disk
        self.key, self.version, self.size = key, version, size
        kept = disk.open_piece(key, version, 0, size)
        self.complete = kept is not None
        if kept is not None:
            self.fd, self.temporary = kept, ""
        else:
            self.fd, self.temporary = disk.begin_piece(key, version, 0, size)

    def write(self, position: int, data: memoryview) -> None:
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], position + done)

    def read(self, lo: int, hi: int) -> bytes:
        """Bytes ``[lo, hi)``, which have arrived."""
        parts = []
        while lo < hi:
            part = os.pread(self.fd, hi - lo, lo)
            if not part:
                raise OSError(f"{self.key}: the cache file ends at {lo} (it was cut short under the mount)")
            parts.append(part)
            lo += len(part)
        return b"".join(parts)

    def finish(self) -> None:
        if self.temporary:
            self.disk.keep_piece(self.key, self.version, 0, self.size, self.temporary)
            self.temporary = ""

    def close(self) -> None:
        os.close(self.fd)


class WholeFile:
    """One file read whole into ``store``: bytes ``[0, arrived)`` are there; readers wait for theirs."""

    def __init__(self, key: str, size: int, store: MemoryStore | DiskStore) -> None:
        self.key = key
        self.size = size
        self.store = store
        self.arrived = size if isinstance(store, DiskStore) and store.complete else 0
        self.error: BaseException | None = None
        self.running = False
        self._moved = threading.Condition()

    @property
    def done(self) -> bool:
        return self.arrived >= self.size

    def begin(self) -> bool:
        """Whether the caller is to start the GET: none runs, and the file is not all here."""
        with self._moved:
            if self.running or self.done:
                return False
            self.running, self.error = True, None
            return True

    def wrote(self, count: int) -> None:
        with self._moved:
            self.arrived += count
            self._moved.notify_all()

    def ended(self, error: BaseException | None) -> None:
        with self._moved:
            self.running, self.error = False, error
            self._moved.notify_all()

    def wait(self, position: int, deadline: float, timeout: float) -> None:
        """Until byte ``position`` has arrived: until ``deadline``, then on for as long as bytes keep coming (a slow
        link is not a stalled server); ``OSError`` if the GET failed or nothing came."""
        with self._moved:
            while self.arrived <= position:
                if self.error is not None and not self.running:
                    raise OSError(f"reading the whole file failed: {first_line(self.error)}") from self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OSError(f"no answer from the server within {timeout:g} s")
                seen = self.arrived
                self._moved.wait(left)
                if self.arrived > seen:
                    deadline = max(deadline, time.monotonic() + timeout)


def fits_in_memory(sizes: list[int], cache: SlotCache) -> bool:
    """Whether files of ``sizes``, read whole, fit in the block cache's slots, ``MEMORY_RESERVE`` left to others."""
    return sum(-(-size // cache.slot_size) for size in sizes) <= cache.count - MEMORY_RESERVE


def memory_needed(sizes: list[int]) -> int:
    """A ``--cache-size`` that holds files of ``sizes`` whole (slots of ``LARGE_BLOCK``, 256 MiB at least)."""
    blocks = sum(-(-size // LARGE_BLOCK) for size in sizes) + MEMORY_RESERVE
    return max(256 * MIB, blocks * LARGE_BLOCK)


def refusal(size: int, option: str, now: int, needed: int, other: str = "") -> str:
    """The one line refusing a file of ``size`` read whole: ``option`` (``--cache-size``, ``--cache-dir-size``) at
    ``now`` does not hold it; ``needed`` would; ``other``: another way out."""
    return (
        f"the server ignores Range requests (it answered 200 with the whole file), so stfs mount reads the whole "
        f"file ({human(size)}) into the cache once, and it does not fit in {option} {human(now)}: give {option} "
        f"{needed // MIB}M or more{other}"
    )


def notice(size: int, folder: str | None) -> str:
    """The warning a mount gives for a file it reads whole."""
    where = f", in {folder}" if folder else ", in memory"
    return f"the server ignores Range requests; reading the whole file ({human(size)}) into the cache once{where}"


def human(count: int) -> str:
    """``count`` bytes for a person: ``1.2 GiB``, ``40.0 MiB``, ``512 bytes``."""
    if count < 1024:
        return f"{count} bytes"
    value = float(count)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"
