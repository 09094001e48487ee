"""Fetched blocks of remote files in one memfd: a fixed set of slots, reused (``--cache-size``).

The memfd is mapped once. A fetch reads the socket straight into a slot (``readinto``) and a reply goes
from the memfd to the kernel by ``splice`` (as a local file's page cache does), so a byte is copied once
in user space, and a slot's pages, once touched, are reused rather than new memory faulted in per request.

``populate`` faults in the pages of the first slots ahead of any fetch (a mount does it in the background):
a fresh shared page costs a fault and zeroing, about 1 CPU-second per GB written, as much as the network
copy; a sequential reader cycles through a few slots, the first ones taken, so it never pays that. Those
faulted-in slots are all filled before any is reused, so a model that fits in them stays whole (a read of
``tensors/`` then of ``files/`` fetches it once); past them, a slot a reader has gone by is reused before a
fresh one is touched.

A slot holds one block of one file (``owner``: key and block number) and the byte ranges of it filled so
far. It is never reused while ``users`` (fills, reads, splices in progress) or ``lent`` (pipes holding its
pages for a reply the kernel has not taken yet) count it, nor while ``shared`` (stfs._native, answering reads
of the bytes published to it) says a reply of its own holds its pages; otherwise the least recently used goes
first.

Every method but ``close`` is called with the ``RemoteFiles`` lock held.
"""

from __future__ import annotations

import itertools
import mmap
import os
import time
from collections import OrderedDict

from .base import SharedBlocks

Owner = tuple[str, int]  # (key, block)
PASSED_SCAN = 16  # slots looked at from the least recently used end for one a reader has gone past
MADV_POPULATE_WRITE = 23  # Linux 5.14 (not in Python's mmap module): fault in pages writable, no data written
LEND_LIMIT = 5.0  # seconds: a lend not returned by then (its thread is gone) no longer holds the slot


class Slot:
    __slots__ = ("index", "owner", "ranges", "users", "lent", "lent_at", "passed")

    def __init__(self, index: int) -> None:
        self.index = index
        self.owner: Owner | None = None
        self.ranges: list[tuple[int, int]] = []  # [lo, hi) file offsets filled, sorted, disjoint
        self.users = 0
        self.lent = 0
        self.lent_at = 0.0
        self.passed = False  # a sequential reader has gone past it: reused before any other

    def covering(self, position: int) -> tuple[int, int] | None:
        for lo, hi in self.ranges:
            if lo <= position < hi:
                return lo, hi
        return None

    def free(self, now: float) -> bool:
        return self.users == 0 and (self.lent == 0 or now - self.lent_at > LEND_LIMIT)


class SlotCache:
    """``count`` slots of ``slot_size`` bytes in one memfd (see the module docstring)."""

    def __init__(self, capacity: int, slot_size: int) -> None:
        self.slot_size = slot_size
        self.count = max(4, capacity // slot_size)
        self.fd = os.memfd_create("stfs-blocks", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.count * slot_size)
        self._memory = mmap.mmap(self.fd, self.count * slot_size)
        self.view = memoryview(self._memory)
        self._slots = [Slot(index) for index in range(self.count)]
        self._unused = list(range(self.count - 1, -1, -1))  # never filled, the lowest index taken first
        self.warm = 0  # slots below this index have their pages faulted in (``populate``)
        self._owned: OrderedDict[Owner, Slot] = OrderedDict()  # least recently used first
        self.shared: SharedBlocks | None = None

    def populate(self, count: int) -> int:
        """Fault in the pages of the first ``count`` slots (those taken first), one slot a call; the slots done
        (fewer where the kernel cannot: the pages are faulted in on first use instead)."""
        for index in range(min(count, self.count)):
            try:
                self._memory.madvise(MADV_POPULATE_WRITE, index * self.slot_size, self.slot_size)
            except (OSError, ValueError):  # an older kernel, or the cache closed meanwhile
                return index
            self.warm = index + 1
        return min(count, self.count)

    def offset(self, slot: Slot, block: int, position: int) -> int:
        """Where file offset ``position`` of ``block`` is in the memfd."""
        return slot.index * self.slot_size + position - block * self.slot_size

    def use(self, owner: Owner, position: int) -> tuple[Slot, int, int] | None:
        """The slot of ``owner`` holding ``position``, counted as used (``release`` it), and the filled range."""
        slot = self._owned.get(owner)
        if slot is None:
            return None
        found = slot.covering(position)
        if found is None:
            return None
        self._owned.move_to_end(owner)
        slot.users += 1
        return slot, found[0], found[1]

    def ranges(self, owner: Owner) -> list[tuple[int, int]]:
        """The ranges of ``owner``'s block filled so far."""
        slot = self._owned.get(owner)
        return list(slot.ranges) if slot is not None else []

    def acquire(self, owner: Owner) -> Slot | None:
        """``owner``'s slot (an unused or the least recently used free one if it has none), counted as used;
        ``None`` when every slot is in use (the caller reads past the cache)."""
        slot = self._owned.get(owner) or self._take(owner)
        if slot is not None:
            self._owned.move_to_end(owner)
            slot.users += 1
        return slot

    def _take(self, owner: Owner) -> Slot | None:
        """A slot for ``owner``: one never used whose pages are faulted in, else one a sequential reader has gone
        past, else one never used, else the least recently used free one. (A fresh page costs a fault and zeroing,
        about as much as the network copy: a loader streaming a model through cycles through a few slots; the
        mount's page cache holds what it read.)"""
        now = time.monotonic()
        slot = self._never_used(warm_only=True)
        if slot is None:
            passed = itertools.islice(self._owned.values(), PASSED_SCAN)
            slot = next((s for s in passed if s.passed and self._reusable(s, now)), None)
        if slot is None:
            slot = self._never_used(warm_only=False)
        if slot is None:
            slot = next((s for s in self._owned.values() if self._reusable(s, now)), None)
        if slot is None:
            return None
        if slot.owner is not None:
            del self._owned[slot.owner]
        slot.ranges = []
        slot.lent = 0
        slot.passed = False
        slot.owner = owner
        self._owned[owner] = slot
        return slot

    def _never_used(self, warm_only: bool) -> Slot | None:
        """The lowest slot never filled (with ``warm_only``, only if ``populate`` has faulted its pages in)."""
        if self._unused and (not warm_only or self._unused[-1] < self.warm):
            return self._slots[self._unused.pop()]
        return None

    def _reusable(self, slot: Slot, now: float) -> bool:
        """Whether ``slot`` may take another block: free here, and withdrawn from ``shared`` with no reply there
        holding its pages (withdrawn either way: it stays so until a read of its block here publishes it again)."""
        return slot.free(now) and (self.shared is None or self.shared.withdraw(slot.index))

    def pass_by(self, owner: Owner) -> None:
        """A sequential reader has read past ``owner``'s block: its slot is the first to be reused."""
        slot = self._owned.get(owner)
        if slot is not None and not slot.passed:
            slot.passed = True
            self._owned.move_to_end(owner, last=False)

    def filled(self, slot: Slot, lo: int, hi: int) -> None:
        """``[lo, hi)`` of the slot's block now holds the file's bytes."""
        merged = [(lo, hi)]
        for a, b in slot.ranges:
            if b < merged[0][0] or a > merged[0][1]:
                merged.append((a, b))
            else:
                merged[0] = (min(a, merged[0][0]), max(b, merged[0][1]))
        slot.ranges = sorted(merged)

    def hold(self, slot: Slot) -> None:
        """One more use of a slot already in use (its bytes still to be written elsewhere): ``release`` it."""
        slot.users += 1

    def release(self, slot: Slot) -> None:
        slot.users -= 1

    def lend(self, slot: Slot) -> None:
        """The slot's pages went into a pipe: keep them until ``give_back``."""
        slot.lent += 1
        slot.lent_at = time.monotonic()

    def give_back(self, slot: Slot, owner: Owner | None) -> None:
        if slot.owner == owner and slot.lent > 0:  # else evicted after LEND_LIMIT: nothing to give back
            slot.lent -= 1

    def close(self) -> None:
        self.view.release()
        self._memory.close()
        os.close(self.fd)
