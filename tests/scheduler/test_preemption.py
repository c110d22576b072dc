"""Preemption by recompute and by swap, victim choice, resume, and executor re-sync."""

from __future__ import annotations

from kvserve.executor.fake.tokens import expected_completion
from kvserve.protos.step import StepResult
from kvserve.protos.stop_rules import FinishReason
from kvserve.testing.scheduler_config import checked_configs
from tests.scheduler.harness import Harness, strict_executor

PROMPTS = {"first": [1, 2, 3, 4], "second": [5, 6, 7, 8]}


# Each request grows to 4 + 11 computed tokens = 4 blocks; 6 blocks cannot hold both.
config = checked_configs(num_blocks=6, block_size=4, max_model_len=32)


def add_both(h: Harness, **first_options) -> None:
    h.add("first", PROMPTS["first"], max_tokens=12, ignore_eos=True, arrival_time=1.0, **first_options)
    h.add("second", PROMPTS["second"], max_tokens=12, ignore_eos=True, arrival_time=2.0)


def assert_complete(h: Harness) -> None:
    for request_id, prompt in PROMPTS.items():
        assert h.tokens(request_id) == expected_completion(prompt, 7, 12)
        assert h.reason(request_id) is FinishReason.LENGTH
    stats = h.scheduler.stats()
    assert stats.blocks_referenced == 0 and stats.blocks_free + stats.blocks_cached == stats.num_blocks
    assert stats.cpu_blocks_used == 0


def seq_ids(h: Harness) -> dict[str, int]:
    return {rid: request.seqs[0].seq_id for rid, request in h.scheduler.view().requests.items()}


def sent_new(h: Harness, seq_id: int) -> list[int]:
    """Steps whose plan (re)introduced the sequence to the executor."""
    return [p.step_id for p in h.plans for s in p.new_seqs if s.seq_id == seq_id]


def dropped(h: Harness, seq_id: int) -> list[int]:
    return [p.step_id for p in h.plans if seq_id in p.drop_seq_ids]


def test_recompute_preempts_the_latest_arrival_and_resumes_it() -> None:
    h = Harness(config())
    add_both(h)
    ids = seq_ids(h)
    h.run()
    assert len(sent_new(h, ids["first"])) == 1
    assert len(sent_new(h, ids["second"])) >= 2
    assert dropped(h, ids["second"])[0] < sent_new(h, ids["second"])[1]
    resumed = [s for plan in h.plans for s in plan.new_seqs if s.seq_id == ids["second"]][1:]
    assert resumed and len(resumed[0].token_ids) > len(PROMPTS["second"])  # keeps its generated tokens
    assert resumed[0].prompt_len == 4
    assert h.scheduler.stats().num_preemptions >= 1
    assert_complete(h)


def test_the_victim_is_the_lowest_priority_even_if_it_arrived_first() -> None:
    h = Harness(config())
    add_both(h, priority=1)
    ids = seq_ids(h)
    h.run()
    assert len(sent_new(h, ids["second"])) == 1
    assert len(sent_new(h, ids["first"])) >= 2
    assert_complete(h)


def test_swap_moves_kv_to_cpu_and_back() -> None:
    h = Harness(config(preemption_mode="swap", num_cpu_blocks=8))
    add_both(h)
    ids = seq_ids(h)
    h.run()
    out_plan = next(p for p in h.plans if p.swap_out)
    in_plan = next(p for p in h.plans if p.swap_in)
    assert out_plan.step_id < in_plan.step_id
    assert ids["second"] in out_plan.drop_seq_ids
    assert sorted(cpu for _dev, cpu in out_plan.swap_out) == sorted(cpu for cpu, _dev in in_plan.swap_in)
    (resumed,) = [s for s in in_plan.new_seqs if s.seq_id == ids["second"]]
    assert resumed.num_computed_tokens == len(resumed.token_ids) - 1  # everything came back, nothing recomputed
    assert resumed.block_table[: len(in_plan.swap_in)] == [dev for _cpu, dev in in_plan.swap_in]
    stats = h.scheduler.stats()
    assert stats.num_swap_outs == sum(1 for p in h.plans if p.swap_out) >= 1
    assert stats.num_swap_outs == stats.num_preemptions  # room on CPU: none fell back to recompute
    assert_complete(h)


def test_swap_without_cpu_room_falls_back_to_recompute() -> None:
    h = Harness(config(preemption_mode="swap", num_cpu_blocks=1))
    add_both(h)
    h.run()
    assert not any(p.swap_out for p in h.plans)
    stats = h.scheduler.stats()
    assert stats.num_preemptions >= 1 and stats.num_swap_outs == 0  # the counter tells recompute from swap
    assert_complete(h)


def test_reset_executor_requeues_everything_and_finishes_identically() -> None:
    h = Harness(config(num_blocks=12))
    add_both(h)
    for _ in range(5):
        h.step()
    plan = h.schedule()  # in flight when the executor dies: its result never comes
    assert h.scheduler.reset_executor(num_blocks=10) == []
    h.executor = strict_executor(10, 4, 0, h.vocab_size)
    assert plan.known_seqs and h.scheduler.update(StepResult(plan.step_id)) == []  # a late result is ignored
    stats = h.scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_blocks, stats.blocks_referenced) == (0, 2, 10, 0)
    resumed = h.step()
    assert len(resumed.new_seqs) == 2 and not resumed.drop_seq_ids
    assert all(s.num_computed_tokens == 0 for s in resumed.new_seqs)
    h.run()
    assert_complete(h)


def test_reset_executor_fails_requests_that_no_longer_fit() -> None:
    h = Harness(config(num_blocks=12))
    h.add("big", list(range(10)), max_tokens=10, ignore_eos=True)
    h.step()
    h.collect(h.scheduler.reset_executor(num_blocks=3))
    h.executor = strict_executor(3, 4, 0, h.vocab_size)
    assert not h.scheduler.has_unfinished()
    h.add("small", [1], max_tokens=2)
    h.run()
    assert h.reason("big") is FinishReason.ERROR
    assert h.reason("small") is FinishReason.LENGTH
