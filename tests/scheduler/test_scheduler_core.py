"""Scheduler basics: chunked prefill, budgets, priorities, n > 1, stop rules, rejections, metrics."""

from __future__ import annotations

import pytest

from kvserve.executor.fake.tokens import expected_completion
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import StepResult
from kvserve.protos.stop_rules import FinishReason, stop_reason
from kvserve.scheduler.core.request import RequestRejected, derive_seed
from kvserve.scheduler.core.scheduler import Scheduler
from kvserve.testing.scheduler_config import checked_configs
from tests.scheduler.harness import Harness

config = checked_configs(num_blocks=32, block_size=4, max_model_len=64, max_num_batched_tokens=64)


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_its_end() -> None:
    h = Harness(config(max_num_batched_tokens=4))
    h.add("a", list(range(10)), max_tokens=2, ignore_eos=True)
    first = h.step()
    assert [(s.num_computed_tokens, s.num_scheduled_tokens, len(s.block_table)) for s in first.new_seqs] == [(0, 4, 1)]
    assert h.completions == {}
    second = h.step()
    (chunk,) = second.known_seqs
    assert (chunk.num_computed_tokens, chunk.num_scheduled_tokens, chunk.new_token_ids, len(chunk.new_block_ids)) == (
        4,
        4,
        [],
        1,
    )
    third = h.step()
    assert (third.known_seqs[0].num_computed_tokens, third.known_seqs[0].num_scheduled_tokens) == (8, 2)
    assert len(h.tokens("a")) == 1
    fourth = h.step()
    assert fourth.known_seqs[0].new_token_ids == h.tokens("a")[:1]
    assert h.reason("a") is FinishReason.LENGTH
    assert h.tokens("a") == expected_completion(range(10), 7, 2)


def test_decodes_get_the_token_budget_before_prefill_chunks() -> None:
    h = Harness(config(max_num_batched_tokens=4))
    h.add("decoder", [1, 2], max_tokens=10, ignore_eos=True)
    h.step()
    h.add("prefill", list(range(20)), max_tokens=1)
    plan = h.step()
    scheduled = {s.seq_id: s.num_scheduled_tokens for s in [*plan.new_seqs, *plan.known_seqs]}
    assert sorted(scheduled.values()) == [1, 3]
    assert plan.num_scheduled_tokens == 4


def test_max_num_seqs_caps_running_sequences() -> None:
    h = Harness(config(max_num_seqs=2))
    for i in range(3):
        h.add(f"r{i}", [i, i + 1], max_tokens=3, ignore_eos=True)
    plan = h.step()
    assert len(plan.new_seqs) == 2
    assert h.scheduler.stats().num_waiting == 1
    h.run()
    assert all(h.reason(f"r{i}") is FinishReason.LENGTH for i in range(3))


def test_priority_first_then_arrival_order() -> None:
    h = Harness(config(max_num_seqs=1))
    h.add("late-low", [1], max_tokens=1, priority=5, arrival_time=1.0)
    h.add("b", [2], max_tokens=1, priority=0, arrival_time=3.0)
    h.add("a", [3], max_tokens=1, priority=0, arrival_time=2.0)
    h.add("urgent", [4], max_tokens=1, priority=-1, arrival_time=4.0)
    h.run()
    assert [rid for rid, _ in h.completions] == ["urgent", "a", "b", "late-low"]


@pytest.mark.parametrize("prompt_len", [5, 6, 8])
def test_n_completions_fork_the_prompt_and_copy_on_write(prompt_len: int) -> None:
    h = Harness(config())
    prompt = list(range(prompt_len))
    h.add("r", prompt, n=3, max_tokens=6, ignore_eos=True, seed=11)
    first = h.step()
    assert len(first.new_seqs) == 1  # completions 1 and 2 wait to fork from completion 0
    parent = first.new_seqs[0]
    second = h.step()
    children = second.new_seqs
    assert len(children) == 2
    shared, slots = divmod(prompt_len - 1, 4)
    for child in children:
        assert child.num_computed_tokens == prompt_len - 1 and child.num_scheduled_tokens == 1
        assert child.block_table[:shared] == parent.block_table[:shared]
        assert child.block_table[shared] not in parent.block_table
    for block in parent.block_table[:shared]:
        assert h.scheduler.ref_count(block) == 3
    expected_copies = [(parent.block_table[shared], c.block_table[shared]) for c in children] if slots else []
    assert second.copies == expected_copies
    assert len({c.seed for c in children} | {parent.seed}) == 3
    h.run()
    for index in range(3):
        assert h.tokens("r", index) == expected_completion(prompt, derive_seed(11, index), 6)
    assert h.scheduler.stats().blocks_referenced == 0


def _tokens(prompt: list[int], seed: int = 7, count: int = 12) -> list[int]:
    return expected_completion(prompt, seed, count)


def test_eos_stops_and_is_reported_with_the_token() -> None:
    prompt = [3, 1, 4]
    natural = _tokens(prompt)
    eos = natural[2]
    h = Harness(config(eos_token_ids=(eos,)))
    h.add("r", prompt, max_tokens=12)
    h.run()
    stop_at = natural.index(eos)
    assert h.tokens("r") == natural[: stop_at + 1]
    assert h.reason("r") is FinishReason.EOS


def test_ignore_eos_runs_to_max_tokens() -> None:
    prompt = [3, 1, 4]
    natural = _tokens(prompt)
    h = Harness(config(eos_token_ids=(natural[0],)))
    h.add("r", prompt, max_tokens=12, ignore_eos=True)
    h.run()
    assert h.tokens("r") == natural and h.reason("r") is FinishReason.LENGTH


def test_min_tokens_defers_eos_and_stop_ids() -> None:
    prompt = [2, 7, 1, 8]
    natural = _tokens(prompt)
    eos = natural[0]
    h = Harness(config(eos_token_ids=(eos,)))
    h.add("r", prompt, max_tokens=12, min_tokens=3)
    h.run()
    later = [i for i, t in enumerate(natural) if t == eos and i >= 3]  # 3 outputs before the one that stops
    if later:
        assert h.tokens("r") == natural[: later[0] + 1] and h.reason("r") is FinishReason.EOS
    else:
        assert h.tokens("r") == natural and h.reason("r") is FinishReason.LENGTH
    assert len(h.tokens("r")) >= 3


def test_stop_token_ids_finish_with_stop() -> None:
    prompt = [5, 5, 5]
    natural = _tokens(prompt)
    stop = natural[3]
    h = Harness(config())
    h.add("r", prompt, max_tokens=12, stop_token_ids=(stop,))
    h.run()
    assert h.tokens("r") == natural[: natural.index(stop) + 1]
    assert h.reason("r") is FinishReason.STOP


def test_max_tokens_finishes_with_length() -> None:
    h = Harness(config())
    h.add("r", [9], max_tokens=5, ignore_eos=True)
    h.run()
    assert len(h.tokens("r")) == 5 and h.reason("r") is FinishReason.LENGTH


def test_stop_reason_rules_directly() -> None:
    sampling = SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=(5,))
    eos = frozenset({9})
    assert stop_reason(sampling, 9, 1, 20, eos, 100) is None  # below min_tokens
    assert stop_reason(sampling, 9, 2, 20, eos, 100) is None  # the min_tokens-th output: still too early
    assert stop_reason(sampling, 9, 3, 20, eos, 100) is FinishReason.EOS
    assert stop_reason(sampling, 5, 3, 20, eos, 100) is FinishReason.STOP
    assert stop_reason(sampling, 1, 10, 20, eos, 100) is FinishReason.LENGTH
    assert stop_reason(sampling, 1, 3, 100, eos, 100) is FinishReason.LENGTH  # max_model_len
    ignoring = SamplingParams(max_tokens=10, ignore_eos=True)
    assert stop_reason(ignoring, 9, 3, 20, eos, 100) is None


def test_rejections_name_the_field() -> None:
    sched = Scheduler(config(num_blocks=4, max_model_len=32))
    sched.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    capacity_cases = [
        ("x", list(range(32)), SamplingParams(max_tokens=1), "prompt"),
        ("x", list(range(20)), SamplingParams(max_tokens=13), "max_tokens"),  # 33 > max_model_len
        ("x", list(range(10)), SamplingParams(max_tokens=10), "max_tokens"),  # needs 5 blocks of 4
    ]
    for request_id, prompt, sampling, field in capacity_cases:
        with pytest.raises(RequestRejected) as info:
            sched.add_request(request_id, prompt, sampling)
        assert info.value.field == field, (prompt, sampling)
    # Validated at the API edge (tests/services/test_request_validation.py); the core only asserts.
    precondition_cases = [
        ("dup", [1], SamplingParams()),
        ("x", [], SamplingParams()),
        ("x", [1, -2], SamplingParams()),
        ("x", [1], SamplingParams(temperature=-1.0)),
        ("x", [1], SamplingParams(n=0)),
    ]
    for request_id, prompt, sampling in precondition_cases:
        with pytest.raises(AssertionError):
            sched.add_request(request_id, prompt, sampling)
    assert sched.stats().num_requests == 1
    sched.add_request("fits", list(range(10)), SamplingParams(max_tokens=7))  # 16 tokens, KV for 16


def test_seeds_are_resolved_and_derived_per_completion() -> None:
    h = Harness(config())
    h.add("r", [1, 2, 3], n=2, max_tokens=2, seed=None)
    h.add("s", [1, 2, 3], n=1, max_tokens=2, seed=123)
    plan = h.step()
    seeds = {s.seq_id: s.seed for s in plan.new_seqs}
    assert len(seeds) == 2 and 123 in seeds.values()
    h.step()
    assert derive_seed(5, 0) == 5 and derive_seed(5, 1) == derive_seed(5, 1) != derive_seed(5, 2)


def test_outputs_carry_logprobs_usage_and_timings() -> None:
    h = Harness(config())
    h.add("r", list(range(9)), max_tokens=3, ignore_eos=True, logprobs=2)
    h.run()
    outs = h.completions[("r", 0)].outputs
    assert [len(o.logprobs) for o in outs] == [1, 1, 1]
    assert outs[0].logprobs[0].token_id == outs[0].new_token_ids[0] and len(outs[0].logprobs[0].top) == 2
    last = outs[-1]
    assert (last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens) == (9, 3, 0)
    assert last.queue_time_s is not None and last.ttft_s is not None and 0 < last.queue_time_s <= last.ttft_s


def test_schedule_twice_without_update_is_refused_and_stale_results_are_ignored() -> None:
    h = Harness(config())
    h.add("r", [1, 2], max_tokens=2)
    plan = h.schedule()
    with pytest.raises(RuntimeError):
        h.scheduler.schedule()
    assert h.scheduler.update(StepResult(plan.step_id + 5)) == []
    h.finish_step(plan)
    assert len(h.tokens("r")) == 1
