"""BlockPool and CpuBlockPool: ref counts, free-vs-cached order, LRU, all-or-nothing allocation."""

from __future__ import annotations

import pytest

from kvserve.scheduler.core.block_pool import BlockPool, CpuBlockPool


def test_allocate_and_release_track_counts() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert blocks is not None and len(set(blocks)) == 3
    assert (pool.num_free, pool.num_cached, pool.num_referenced) == (1, 0, 3)
    assert all(pool.ref_counts[b] == 1 for b in blocks)
    pool.ref(blocks[0])
    assert pool.ref_counts[blocks[0]] == 2
    pool.release(blocks[0])
    pool.release_table(blocks)
    assert (pool.num_free, pool.num_cached, pool.num_referenced) == (4, 0, 0)


def test_failed_allocation_leaves_ref_counts_untouched() -> None:
    pool = BlockPool(4)
    held = pool.allocate(2)
    pool.mark_cached(held[0])
    pool.release(held[0])  # one cached block, one free block, one referenced
    before = list(pool.ref_counts), pool.free_blocks(), pool.cached_blocks_lru()
    assert pool.allocate(4) is None
    assert (list(pool.ref_counts), pool.free_blocks(), pool.cached_blocks_lru()) == before


def test_free_blocks_are_used_before_cached_ones() -> None:
    evicted: list[int] = []
    pool = BlockPool(3)
    pool.set_evict_hook(evicted.append)
    hit = pool.allocate(1)[0]
    pool.mark_cached(hit)
    pool.release(hit)
    taken = pool.allocate(2)
    assert hit not in taken and evicted == []
    assert pool.cached_blocks_lru() == [hit]
    assert pool.allocate(1) == [hit] and evicted == [hit]
    assert not pool.is_cached(hit)


def test_cached_blocks_are_evicted_least_recently_released_first() -> None:
    evicted: list[int] = []
    pool = BlockPool(4)
    pool.set_evict_hook(evicted.append)
    blocks = pool.allocate(4)
    for b in blocks:
        pool.mark_cached(b)
    pool.release(blocks[2])
    pool.release_table([blocks[0], blocks[1]])  # tail-first: blocks[1] before blocks[0]
    pool.release(blocks[3])
    assert pool.cached_blocks_lru() == [blocks[2], blocks[1], blocks[0], blocks[3]]
    pool.ref(blocks[1])  # a hit takes it out of the LRU
    pool.release(blocks[1])  # ... and it comes back as most recent
    assert pool.allocate(3) is not None
    assert evicted == [blocks[2], blocks[0], blocks[3]]


def test_evictions_are_counted_on_both_allocation_paths() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    assert blocks is not None
    for block in blocks:
        pool.mark_cached(block)
    pool.release_table(blocks)
    assert pool.num_cached == 4 and pool.num_evicted_total == 0
    assert pool.allocate(3) is not None  # no free block: three cached ones are taken back
    assert pool.num_evicted_total == 3
    assert pool.allocate_one() is not None
    assert pool.num_evicted_total == 4 and pool.num_cached == 0


def test_misuse_is_refused() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.ref(0)  # free blocks cannot be shared
    with pytest.raises(ValueError):
        pool.release(0)
    with pytest.raises(ValueError):
        pool.mark_cached(1)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_cpu_pool_is_all_or_nothing() -> None:
    cpu = CpuBlockPool(3)
    first = cpu.allocate(2)
    assert first is not None and cpu.num_free == 1
    assert cpu.allocate(2) is None and cpu.num_free == 1
    cpu.release(first)
    assert sorted(cpu.free_blocks()) == [0, 1, 2]
