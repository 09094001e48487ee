"""The remote block cache's choice of slot (stfs.sources.block_cache), without a mount: the slots whose pages a
mount faulted in are filled before any block is evicted; past them, a block a reader has gone by goes before a
fresh slot is touched."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stfs.sources.block_cache import SlotCache

SLOT = 1 << 20


@pytest.fixture
def cache() -> Iterator[SlotCache]:
    made = SlotCache(8 * SLOT, SLOT)
    yield made
    made.close()


def fill(cache: SlotCache, block: int, passed: bool = True) -> int:
    """Fetch ``block`` of one file into a slot as a reader would, then go past it; the slot's index."""
    owner = ("m.safetensors", block)
    slot = cache.acquire(owner)
    assert slot is not None
    cache.filled(slot, block * SLOT, (block + 1) * SLOT)
    cache.release(slot)
    if passed:
        cache.pass_by(owner)
    return slot.index


def held(cache: SlotCache, block: int) -> bool:
    return cache.ranges(("m.safetensors", block)) == [(block * SLOT, (block + 1) * SLOT)]


def test_a_model_that_fits_in_the_faulted_in_slots_stays_whole(cache: SlotCache) -> None:
    assert cache.populate(4) == 4
    assert [fill(cache, block) for block in range(4)] == [0, 1, 2, 3]
    assert all(held(cache, block) for block in range(4))  # read past, but nothing had to make room


def test_past_the_faulted_in_slots_a_block_read_past_goes_before_a_fresh_slot(cache: SlotCache) -> None:
    cache.populate(2)
    fill(cache, 0)
    fill(cache, 1, passed=False)
    assert fill(cache, 2) == 0  # block 0's slot, read past: its pages are in; slot 2's are not
    assert not held(cache, 0) and held(cache, 1) and held(cache, 2)
    assert fill(cache, 3) == 0  # block 2 was read past too; block 1 (not read past) stays
    assert held(cache, 1)


def test_with_nothing_read_past_a_fresh_slot_is_taken_before_any_block_is_evicted(cache: SlotCache) -> None:
    cache.populate(1)
    indexes = [fill(cache, block, passed=False) for block in range(8)]
    assert indexes == list(range(8))
    assert all(held(cache, block) for block in range(8))
    assert fill(cache, 8, passed=False) == 0  # full: the least recently used
    assert not held(cache, 0)
