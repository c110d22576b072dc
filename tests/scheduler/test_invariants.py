"""check_invariants() catches corrupted state, debug mode runs it, debug_dump shows tables and ref counts.

These tests must reach past the public API: they corrupt the live pool (through `view().pool`), a
sequence's table and, once, the scheduler's own queues (`Scheduler._state`), to prove each rule
catches its breach."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.scheduler.core.invariants import InvariantError
from kvserve.scheduler.core.scheduler_config import SchedulerConfig
from tests.scheduler.harness import Harness


def running_harness(**overrides) -> Harness:
    values = dict(num_blocks=16, block_size=4, max_model_len=32)
    values.update(overrides)
    h = Harness(SchedulerConfig(**values))
    h.add("a", list(range(9)), max_tokens=6, ignore_eos=True)
    h.add("b", list(range(9)), max_tokens=6, ignore_eos=True)
    h.step()
    h.step()
    h.scheduler.check_invariants()
    return h


def test_a_leaked_reference_is_caught() -> None:
    h = running_harness()
    seq = h.scheduler.view().running[0]
    h.scheduler.view().pool.ref_counts[seq.block_table[-1]] += 1
    with pytest.raises(InvariantError, match="ref count"):
        h.scheduler.check_invariants()


def test_a_block_freed_twice_is_caught() -> None:
    h = running_harness()
    pool = h.scheduler.view().pool
    pool._free.append(pool._free[0])
    with pytest.raises(InvariantError, match="free list"):
        h.scheduler.check_invariants()


def test_a_lost_block_is_caught() -> None:
    h = running_harness()
    h.scheduler.view().pool._free.pop()
    with pytest.raises(InvariantError, match="total"):
        h.scheduler.check_invariants()


def test_a_broken_tree_chain_is_caught() -> None:
    h = running_harness()
    seq = next(s for s in h.scheduler.view().running if s.num_tree_blocks > 0)
    seq.block_table[0], seq.block_table[1] = seq.block_table[1], seq.block_table[0]
    with pytest.raises(InvariantError, match="tree chain"):
        h.scheduler.check_invariants()


def test_a_misplaced_sequence_is_caught() -> None:
    h = running_harness()
    h.scheduler._state.waiting.append(h.scheduler.view().running[0])  # corrupts the queues on purpose
    with pytest.raises(InvariantError, match="two queues"):
        h.scheduler.check_invariants()


def test_debug_mode_checks_inside_the_scheduler() -> None:
    h = running_harness(debug_invariants=True)
    h.scheduler.view().pool.ref_counts[0] += 1
    with pytest.raises(InvariantError):
        h.scheduler.schedule()


def test_debug_dump_lists_block_tables_with_ref_counts() -> None:
    h = running_harness()
    dump = h.scheduler.debug_dump()
    for seq in h.scheduler.view().running:
        assert f"seq {seq.seq_id} " in dump
        shared = seq.block_table[0]
        assert f"{shared}(rc={h.scheduler.ref_count(shared)}" in dump
    assert "request 'a'" in dump and "free" in dump and "evictable" in dump


def test_the_view_is_a_read_only_snapshot() -> None:
    h = running_harness()
    view = h.scheduler.view()
    assert view.step_id == 2 and view.inflight_step_id is None and view.pinned == () and view.pending_drops == ()
    assert len(view.running) == 2 and view.waiting == () and view.swapped == () and set(view.requests) == {"a", "b"}
    assert view.pool.num_blocks == 16 and view.block_size == 4
    with pytest.raises(TypeError):
        view.requests["c"] = view.requests["a"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.step_id = 0
    h.scheduler.abort("a")
    assert set(view.requests) == {"a", "b"} and set(h.scheduler.view().requests) == {"b"}
