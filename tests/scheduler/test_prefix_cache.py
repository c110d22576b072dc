"""Prefix caching through the scheduler: live hits, partial-block copies, namespaces, cache-aware order."""

from __future__ import annotations

from kvserve.executor.fake.tokens import expected_completion
from kvserve.testing.scheduler_config import checked_configs
from tests.scheduler.harness import Harness

config = checked_configs(num_blocks=32, block_size=4, max_model_len=64)


def test_prefill_hits_blocks_of_a_request_that_is_still_running() -> None:
    h = Harness(config(max_num_batched_tokens=8))
    prompt = list(range(10))
    h.add("source", prompt, max_tokens=8, ignore_eos=True)
    (source,) = h.step().new_seqs  # computes 8 tokens: blocks 0 and 1 fill and enter the tree
    h.add("follower", prompt[:8] + [40, 41, 42], max_tokens=2, ignore_eos=True)
    plan = h.step()
    (follower,) = plan.new_seqs
    assert follower.num_computed_tokens == 8 and follower.num_scheduled_tokens == 3
    assert follower.block_table[:2] == source.block_table[:2]
    assert [h.scheduler.ref_count(b) for b in source.block_table[:2]] == [2, 2]
    assert h.scheduler.has_unfinished()
    h.run()
    assert h.tokens("follower") == expected_completion(prompt[:8] + [40, 41, 42], 7, 2)
    assert h.completions[("follower", 0)].outputs[-1].num_cached_tokens == 8
    stats = h.scheduler.stats()
    assert stats.prefix_hit_tokens >= 8 and stats.blocks_referenced == 0


def test_a_match_ending_inside_a_block_copies_its_slots() -> None:
    h = Harness(config())
    h.add("a", list(range(10)), max_tokens=1)
    (a,) = h.step().new_seqs
    assert not h.scheduler.has_unfinished()
    h.add("b", [0, 1, 2, 3, 4, 5, 77, 78], max_tokens=2, ignore_eos=True)
    plan = h.step()
    (b,) = plan.new_seqs
    assert b.num_computed_tokens == 6
    assert b.block_table[0] == a.block_table[0]
    assert plan.copies == [(a.block_table[1], b.block_table[1])]
    h.run()
    assert h.tokens("b") == expected_completion([0, 1, 2, 3, 4, 5, 77, 78], 7, 2)


def test_the_partial_tail_of_a_finished_request_is_matchable() -> None:
    h = Harness(config())
    h.add("a", list(range(10)), max_tokens=1)
    (a,) = h.step().new_seqs  # positions 8 and 9 sit in a's partial third block
    h.add("b", list(range(10)) + [50], max_tokens=1)
    plan = h.step()
    (b,) = plan.new_seqs
    assert b.num_computed_tokens == 10
    assert b.block_table[:2] == a.block_table[:2]
    assert plan.copies == [(a.block_table[2], b.block_table[2])]


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    h = Harness(config())
    prompt = list(range(8))
    h.add("a", prompt, max_tokens=1)
    (a,) = h.step().new_seqs
    h.add("b", prompt, max_tokens=3, ignore_eos=True)
    plan = h.step()
    (b,) = plan.new_seqs
    assert (b.num_computed_tokens, b.num_scheduled_tokens) == (7, 1)
    assert plan.copies == [(a.block_table[1], b.block_table[1])]  # never written in place: it is shared
    h.run()
    assert h.tokens("b") == expected_completion(prompt, 7, 3)


def test_namespaces_never_share_blocks() -> None:
    h = Harness(config())
    prompt = list(range(12))
    h.add("a", prompt, max_tokens=1, namespace="model|tenant-a")
    (a,) = h.step().new_seqs
    h.add("b", prompt, max_tokens=1, namespace="model|tenant-b")
    plan = h.step()
    (b,) = plan.new_seqs
    assert b.num_computed_tokens == 0 and plan.copies == []
    assert not set(a.block_table) & set(b.block_table)
    h.add("c", prompt, max_tokens=1, namespace="model|tenant-a")
    assert h.step().new_seqs[0].num_computed_tokens == 11


def test_prefix_caching_can_be_switched_off() -> None:
    h = Harness(config(enable_prefix_caching=False))
    h.add("a", list(range(12)), max_tokens=1)
    h.step()
    h.add("b", list(range(12)), max_tokens=1)
    assert h.step().new_seqs[0].num_computed_tokens == 0
    stats = h.scheduler.stats()
    assert stats.blocks_cached == 0 and stats.blocks_free == stats.num_blocks


def test_a_cached_prefix_survives_while_free_blocks_remain() -> None:
    h = Harness(config(num_blocks=8))
    h.add("a", list(range(8)), max_tokens=1)
    (a,) = h.step().new_seqs
    h.add("filler", [60 + i for i in range(15)], max_tokens=1)  # needs 4 blocks; 6 are free
    (filler,) = h.step().new_seqs
    assert not set(filler.block_table) & set(a.block_table)
    h.add("b", list(range(8)) + [1], max_tokens=1)
    assert h.step().new_seqs[0].num_computed_tokens == 8


def _waiting_pair(cache_aware: bool, max_skips: int = 8) -> Harness:
    h = Harness(config(max_num_seqs=1, cache_aware_order=cache_aware, cache_aware_max_skips=max_skips))
    h.add("warm", list(range(12)), max_tokens=1)
    h.step()
    h.add("cold", [30, 31, 32, 33, 34], max_tokens=1, arrival_time=1.0)
    h.add("hit", list(range(12)) + [5], max_tokens=1, arrival_time=2.0)
    h.run()
    return h


def test_fcfs_order_by_default() -> None:
    assert [rid for rid, _ in _waiting_pair(False).completions] == ["warm", "cold", "hit"]


def test_cache_aware_order_admits_the_longest_hit_first() -> None:
    assert [rid for rid, _ in _waiting_pair(True).completions] == ["warm", "hit", "cold"]


def test_cache_aware_order_has_a_starvation_bound() -> None:
    assert [rid for rid, _ in _waiting_pair(True, max_skips=0).completions] == ["warm", "cold", "hit"]
