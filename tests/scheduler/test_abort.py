"""abort() in every state, finish_sequence() (the stop-string hook) and fail_all()."""

from __future__ import annotations

from kvserve.executor.fake.tokens import expected_completion
from kvserve.protos.stop_rules import FinishReason
from kvserve.scheduler.core.request import SequenceStatus
from kvserve.testing.scheduler_config import checked_configs
from tests.scheduler.harness import Harness

config = checked_configs(num_blocks=32, block_size=4, max_model_len=32)


def assert_all_blocks_back(h: Harness) -> None:
    stats = h.scheduler.stats()
    assert stats.blocks_referenced == 0 and stats.blocks_free + stats.blocks_cached == stats.num_blocks
    assert stats.cpu_blocks_used == 0


def status_of(h: Harness, request_id: str, index: int = 0) -> SequenceStatus:
    return h.scheduler.request(request_id).seqs[index].status


def test_abort_unknown_request_returns_nothing() -> None:
    h = Harness(config())
    assert h.scheduler.abort("nope") == []
    assert h.scheduler.finish_sequence("nope", 0) is None


def test_abort_while_waiting() -> None:
    h = Harness(config())
    h.add("r", [1, 2, 3], n=2)
    outputs = h.scheduler.abort("r")
    assert [(o.index, o.finish_reason, o.new_token_ids) for o in outputs] == [
        (0, FinishReason.ABORT, []),
        (1, FinishReason.ABORT, []),
    ]
    assert not h.scheduler.has_unfinished()
    assert h.schedule().is_empty  # the executor never knew it: nothing to drop
    assert_all_blocks_back(h)


def test_abort_while_prefilling_and_while_decoding() -> None:
    h = Harness(config(max_num_batched_tokens=4))
    h.add("prefilling", list(range(12)), max_tokens=4)
    h.add("decoding", [1], max_tokens=10, ignore_eos=True)
    h.step()
    h.step()
    assert status_of(h, "prefilling") is SequenceStatus.RUNNING
    prefill_id = h.scheduler.request("prefilling").seqs[0].seq_id
    (out,) = h.scheduler.abort("prefilling")
    assert out.finish_reason is FinishReason.ABORT
    plan = h.step()
    assert plan.drop_seq_ids == [prefill_id]
    decode_id = h.scheduler.request("decoding").seqs[0].seq_id
    h.scheduler.abort("decoding", FinishReason.ERROR)
    assert h.step().drop_seq_ids == [decode_id]
    assert_all_blocks_back(h)


def test_abort_while_its_step_is_in_flight_ignores_the_sampled_token() -> None:
    h = Harness(config())
    h.add("r", [1, 2, 3], max_tokens=5, ignore_eos=True)
    h.add("other", [4, 5], max_tokens=2, ignore_eos=True)
    h.step()
    plan = h.schedule()
    outputs = h.scheduler.abort("r")
    h.collect(outputs)
    assert [o.num_output_tokens for o in outputs] == [1]
    h.finish_step(plan)  # the executor still returns r's token
    assert h.tokens("r") == expected_completion([1, 2, 3], 7, 1)
    assert h.reason("r") is FinishReason.ABORT
    h.run()
    assert_all_blocks_back(h)


def _tight(h_mode: str) -> Harness:
    cfg = config(num_blocks=6, preemption_mode=h_mode, num_cpu_blocks=8 if h_mode == "swap" else 0)
    h = Harness(cfg)
    h.add("first", [1, 2, 3, 4], max_tokens=12, ignore_eos=True, arrival_time=1.0)
    h.add("second", [5, 6, 7, 8], max_tokens=12, ignore_eos=True, arrival_time=2.0)
    return h


def _step_until(h: Harness, request_id: str, status: SequenceStatus) -> None:
    for _ in range(40):
        h.step()
        if status_of(h, request_id) is status:
            return
    raise AssertionError(f"{request_id} never became {status}")


def test_abort_while_swapped_out() -> None:
    h = _tight("swap")
    _step_until(h, "second", SequenceStatus.SWAPPED)
    assert h.scheduler.stats().cpu_blocks_used > 0
    (out,) = h.scheduler.abort("second")
    assert out.finish_reason is FinishReason.ABORT and out.num_output_tokens > 0
    h.run()
    assert h.tokens("first") == expected_completion([1, 2, 3, 4], 7, 12)
    assert_all_blocks_back(h)


def test_abort_while_preempted_waiting() -> None:
    h = _tight("recompute")
    _step_until(h, "second", SequenceStatus.PREEMPTED)
    h.collect(h.scheduler.abort("second"))
    h.run()
    assert h.reason("second") is FinishReason.ABORT
    assert h.tokens("first") == expected_completion([1, 2, 3, 4], 7, 12)
    assert_all_blocks_back(h)


def test_abort_while_a_completion_waits_to_fork() -> None:
    h = Harness(config(max_num_batched_tokens=4))
    h.add("r", list(range(10)), n=3, max_tokens=3)
    h.step()
    assert status_of(h, "r", 1) is SequenceStatus.WAITING
    assert len(h.scheduler.abort("r")) == 3
    h.step()
    assert_all_blocks_back(h)


def test_finish_sequence_ends_one_completion_for_a_stop_string() -> None:
    h = Harness(config())
    h.add("r", [1, 2, 3], n=2, max_tokens=6, ignore_eos=True, seed=3)
    h.step()
    h.step()
    out = h.scheduler.finish_sequence("r", 1)
    assert out is not None and out.finish_reason is FinishReason.STOP and out.index == 1
    assert h.scheduler.finish_sequence("r", 1) is None
    assert h.scheduler.finish_sequence("r", 7) is None
    h.run()
    assert h.reason("r", 0) is FinishReason.LENGTH and len(h.tokens("r", 0)) == 6
    assert_all_blocks_back(h)


def test_fail_all_ends_every_request_in_every_state() -> None:
    h = _tight("swap")
    h.add("queued", [9] * 14, max_tokens=10, arrival_time=3.0)  # needs 4 free blocks: stays queued
    _step_until(h, "second", SequenceStatus.SWAPPED)
    h.schedule()  # even with a plan in flight
    outputs = h.scheduler.fail_all()
    assert sorted(o.request_id for o in outputs) == ["first", "queued", "second"]
    assert all(o.finish_reason is FinishReason.ERROR for o in outputs)
    assert not h.scheduler.has_unfinished()
    h.scheduler.check_invariants()
    assert_all_blocks_back(h)
