"""Per-request block accounting (`BlockCounts`) adds up, and agrees with the pool's own counters.

Every block reference a request takes (a new block, or a shared one at admission) it gives back:
`allocated + hit - copied == freed` once it has ended (a partial hit's source block is only
pinned while its copy is planned). Over a whole workload the requests' sums are the pool's
`num_allocated_total`, `num_shared_total` and `num_released_total`.
"""

from __future__ import annotations

import pytest

from kvserve.protos.stop_rules import FinishReason
from kvserve.scheduler.core.invariants import InvariantError
from kvserve.scheduler.core.outputs import BlockCounts
from kvserve.scheduler.core.scheduler_config import SchedulerConfig
from tests.scheduler.harness import Harness, strict_executor

STEM = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks of 4 shared by a, b, c and e


def final_counts(h: Harness) -> dict[str, BlockCounts]:
    counts: dict[str, BlockCounts] = {}
    for (request_id, _index), completion in h.completions.items():
        assert completion.finish_reason is not None
        blocks = completion.outputs[-1].blocks
        assert blocks is not None
        assert counts.setdefault(request_id, blocks) is blocks  # one object per request, in every output
    return counts


def run_workload(mode: str, kv_reservation: str = "paged") -> tuple[Harness, dict[str, BlockCounts]]:
    h = Harness(
        SchedulerConfig(
            num_blocks=14,
            block_size=4,
            max_model_len=40,
            num_cpu_blocks=16,
            preemption_mode=mode,
            kv_reservation=kv_reservation,
            max_num_batched_tokens=64,
            debug_invariants=True,
        )
    )
    h.add("a", [*STEM, 20, 21], max_tokens=14, ignore_eos=True, arrival_time=1.0)
    for _ in range(3):
        h.step()  # a's first three blocks (the third: 20, 21 and two outputs) are in the tree now
    h.add("b", [*STEM, 22, 23, 24], max_tokens=10, n=2, seed=5, temperature=1.0, ignore_eos=True, arrival_time=2.0)
    h.add("c", [*STEM, 25], max_tokens=12, ignore_eos=True, arrival_time=3.0)
    h.add("d", [40, 41, 42, 43, 44], max_tokens=30, ignore_eos=True, arrival_time=4.0)
    h.add("e", [*STEM, 20, 21, 99], max_tokens=6, ignore_eos=True, arrival_time=5.0)
    for _ in range(6):
        h.step()
    h.collect(h.scheduler.abort("d"))
    h.run()
    return h, final_counts(h)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_every_reference_taken_is_given_back_and_the_pool_agrees(mode: str) -> None:
    h, counts = run_workload(mode)
    stats = h.scheduler.stats()
    assert stats.num_preemptions >= 1, "the workload must preempt"
    assert h.reason("d") is FinishReason.ABORT
    for request_id, c in counts.items():
        assert c.allocated + c.hit - c.copied == c.freed, (request_id, c)
    pool = h.scheduler.view().pool
    total_allocated = sum(c.allocated for c in counts.values())
    total_hit = sum(c.hit for c in counts.values())
    total_copied = sum(c.copied for c in counts.values())
    total_freed = sum(c.freed for c in counts.values())
    assert total_allocated == pool.num_allocated_total
    assert total_hit == pool.num_shared_total  # each copy source was pinned by one ref...
    assert total_freed + total_copied == pool.num_released_total  # ...and released by the plan's unpin
    assert total_allocated + total_hit - total_copied == total_freed
    assert stats.blocks_referenced == 0 and sum(pool.ref_counts) == 0
    # Each counter means something here: shared stems hit, the fork copies, a recompute re-allocates.
    assert counts["b"].hit >= 2 * 2 and counts["b"].copied >= 1  # completion 1 forks from completion 0
    assert counts["e"].hit >= 3 and counts["e"].copied >= 1  # a's third block, matched for 2 slots
    assert counts["a"].hit == 0
    assert total_allocated > sum(-(-len(c.tokens) // 4) for c in h.completions.values())


def test_a_reservation_changes_nothing_in_the_accounting() -> None:
    h, counts = run_workload("recompute", "max-model-len")
    pool = h.scheduler.view().pool
    assert h.scheduler.stats().num_preemptions == 0
    assert sum(c.allocated for c in counts.values()) == pool.num_allocated_total
    assert sum(c.freed + c.copied for c in counts.values()) == pool.num_released_total
    for c in counts.values():
        assert c.allocated + c.hit - c.copied == c.freed


def test_an_executor_reset_counts_the_dropped_tables_as_freed() -> None:
    h = Harness(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=32))
    h.add("a", [1, 2, 3, 4, 5, 6], max_tokens=8, ignore_eos=True)
    h.step()
    counts = h.scheduler.request("a").blocks
    held = counts.allocated
    assert held == 2 and counts.freed == 0
    h.scheduler.reset_executor()
    h.executor = strict_executor(16, 4)
    assert counts.freed == held
    h.scheduler.check_invariants()
    h.run()
    assert counts.allocated + counts.hit - counts.copied == counts.freed and counts.allocated > held


def test_broken_counts_are_caught() -> None:
    h = Harness(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=32))
    h.add("a", [1, 2, 3, 4, 5, 6], max_tokens=8, ignore_eos=True)
    h.step()
    h.scheduler.request("a").blocks.freed += 1
    with pytest.raises(InvariantError, match="blocks its tables hold"):
        h.scheduler.check_invariants()
    h.scheduler.request("a").blocks.freed -= 1
    h.scheduler.view().pool.num_released_total += 1
    with pytest.raises(InvariantError, match="pool counters"):
        h.scheduler.check_invariants()
