"""`kv_reservation`: preallocating a sequence's whole context at admission, on the same paged pool.

Under `max-model-len` (or `prompt-plus-max-tokens`) a running sequence holds its table plus a
reservation of the blocks it may still grow into, so concurrency is what a contiguous-KV engine
gets, nothing is ever preempted for memory, and every token equals the paged run's.
"""

from __future__ import annotations

import pytest

from kvserve.executor.fake.tokens import expected_completion
from kvserve.protos.stop_rules import FinishReason
from kvserve.scheduler.core.invariants import InvariantError
from kvserve.scheduler.core.kv_manager import KvManager
from kvserve.scheduler.core.request import RequestRejected, SequenceStatus
from kvserve.scheduler.core.scheduler_config import KV_RESERVATIONS, SchedulerConfig
from kvserve.testing.scheduler_config import checked_configs
from tests.scheduler.harness import Harness, strict_executor

RESERVING = tuple(policy for policy in KV_RESERVATIONS if policy != "paged")


config = checked_configs(
    num_blocks=20,
    block_size=4,
    max_model_len=32,
    max_num_seqs=16,
    max_num_batched_tokens=256,
    enable_prefix_caching=False,
)


def run_recording_concurrency(h: Harness, blocks_per_seq: int | None = None) -> list[int]:
    """Run to the end; the number of running sequences after each plan.

    With `blocks_per_seq` (nothing shared, one reservation size), also check that every running
    sequence holds exactly that many blocks, in its table or reserved.
    """
    running = []
    while h.scheduler.has_unfinished():
        plan = h.step()
        assert not plan.is_empty, h.scheduler.debug_dump()
        stats = h.scheduler.stats()
        running.append(stats.num_running)
        if blocks_per_seq is not None:
            assert stats.blocks_referenced + stats.blocks_reserved == stats.num_running * blocks_per_seq
    return running


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "max_model_len"), [(20, 4, 32), (33, 4, 32), (7, 1, 7), (100, 16, 256), (8, 4, 30)]
)
def test_max_model_len_concurrency_is_num_blocks_over_blocks_per_context(num_blocks, block_size, max_model_len) -> None:
    blocks_per_context = -(-max_model_len // block_size)
    expected = num_blocks // blocks_per_context
    cfg = config(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len)
    reserving = Harness(config(**{**_fields(cfg), "kv_reservation": "max-model-len"}))
    paged = Harness(cfg)
    for h in (reserving, paged):
        for i in range(3 * expected + 2):
            h.add(f"r{i}", [10 + i, 11, 12], max_tokens=3, ignore_eos=True)
    concurrency = run_recording_concurrency(reserving, blocks_per_context)
    assert max(concurrency) == expected and concurrency.count(expected) >= 2
    assert max(run_recording_concurrency(paged)) > expected  # the reservation, not the requests, set the limit
    assert _tokens(reserving) == _tokens(paged)
    assert reserving.scheduler.stats().blocks_reserved == 0


def test_prompt_plus_max_tokens_reserves_each_requests_own_length() -> None:
    h = Harness(config(kv_reservation="prompt-plus-max-tokens"))  # 20 blocks of 4 tokens
    for i in range(8):
        h.add(f"r{i}", [10 + i, 11, 12, 13, 14, 15], max_tokens=10, ignore_eos=True)  # 16 tokens: 4 blocks
    concurrency = run_recording_concurrency(h, 4)
    assert max(concurrency) == 5
    h2 = Harness(config(kv_reservation="prompt-plus-max-tokens"))
    h2.add("long", [1, 2, 3], max_tokens=29, ignore_eos=True)  # 32 tokens: 8 blocks
    h2.add("short", [4, 5, 6], max_tokens=1, ignore_eos=True)  # 4 tokens: 1 block
    plan = h2.schedule()
    stats = h2.scheduler.stats()
    assert stats.blocks_reserved + stats.blocks_referenced == 8 + 1 and stats.num_running == 2
    h2.finish_step(plan)
    h2.run()


WORKLOAD = [
    ("a", [1, 2, 3, 4, 5, 6, 7, 8, 20], dict(max_tokens=9)),
    ("b", [1, 2, 3, 4, 5, 6, 7, 8, 21, 22], dict(max_tokens=7, n=2, seed=3, temperature=1.0)),
    ("c", [1, 2, 3, 4, 5, 6], dict(max_tokens=12, stop_token_ids=(7,))),
    ("d", [30, 31, 32, 33, 34], dict(max_tokens=10, n=3, seed=11, temperature=1.0)),
    ("e", [1, 2, 3, 4, 5, 6, 7, 8, 20], dict(max_tokens=5, min_tokens=2)),
]


def _run_workload(**overrides) -> Harness:
    h = Harness(config(eos_token_ids=(0,), **overrides))
    for request_id, prompt, sampling in WORKLOAD:
        h.add(request_id, prompt, **sampling)
    h.run()
    return h


@pytest.mark.parametrize("kv_reservation", RESERVING)
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("chunk", [256, 3])
def test_tokens_equal_the_paged_run(kv_reservation: str, caching: bool, chunk: int) -> None:
    knobs = dict(enable_prefix_caching=caching, max_num_batched_tokens=chunk, num_blocks=24)
    paged = _run_workload(**knobs)
    reserving = _run_workload(kv_reservation=kv_reservation, **knobs)
    assert _tokens(reserving) == _tokens(paged)
    assert len(_tokens(paged)) == 1 + 2 + 1 + 3 + 1
    stats = reserving.scheduler.stats()
    assert stats.blocks_referenced == stats.blocks_reserved == 0 and stats.num_preemptions == 0


@pytest.mark.parametrize("kv_reservation", RESERVING)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_reserving_never_preempts_where_paged_must(kv_reservation: str, mode: str) -> None:
    # Two requests growing to 16 tokens (4 blocks each) in 6 blocks: paged admits both, then preempts one.
    knobs = dict(num_blocks=6, max_model_len=16, preemption_mode=mode, num_cpu_blocks=8)
    runs = {}
    for policy in ("paged", kv_reservation):
        h = Harness(config(kv_reservation=policy, **knobs))
        h.add("first", [1, 2, 3, 4], max_tokens=12, ignore_eos=True, arrival_time=1.0)
        h.add("second", [5, 6, 7, 8], max_tokens=12, ignore_eos=True, arrival_time=2.0)
        runs[policy] = (run_recording_concurrency(h), h)
    assert runs["paged"][1].scheduler.stats().num_preemptions >= 1
    concurrency, h = runs[kv_reservation]
    assert max(concurrency) == 1 and h.scheduler.stats().num_preemptions == 0
    assert _tokens(h) == _tokens(runs["paged"][1])
    for prompt, request_id in (([1, 2, 3, 4], "first"), ([5, 6, 7, 8], "second")):
        assert h.tokens(request_id) == expected_completion(prompt, 7, 12)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_reservation_is_returned_and_taken_again_on_resume(monkeypatch, mode: str) -> None:
    """Preemption never happens for memory under a reservation; forced, it still keeps every rule."""
    h = Harness(config(kv_reservation="max-model-len", preemption_mode=mode, num_cpu_blocks=16, num_blocks=24))
    h.add("first", [1, 2, 3, 4, 5], max_tokens=20, ignore_eos=True, arrival_time=1.0)
    h.add("second", [6, 7, 8, 9, 10], max_tokens=20, ignore_eos=True, arrival_time=2.0)
    for _ in range(5):
        h.step()
    sched = h.scheduler
    assert sched.stats().blocks_reserved + sched.stats().blocks_referenced == 2 * 8
    real_allocate = KvManager.allocate
    refused = []

    def refuse_once(self, seq, need):  # the pool "runs out" once: the last running sequence is preempted
        if not refused:
            refused.append(seq.seq_id)
            return None
        return real_allocate(self, seq, need)

    monkeypatch.setattr(KvManager, "allocate", refuse_once)
    while not refused:
        h.step()
    monkeypatch.undo()
    second = sched.request("second").seqs[0]
    expected_state = SequenceStatus.SWAPPED if mode == "swap" else SequenceStatus.PREEMPTED
    assert second.status is expected_state and second.reserved_blocks == 0
    assert sched.stats().blocks_reserved + sched.stats().blocks_referenced == 8
    h.run()
    assert sched.stats().num_preemptions == 1
    if mode == "swap":
        assert any(p.swap_in for p in h.plans)
    for request_id, prompt in (("first", [1, 2, 3, 4, 5]), ("second", [6, 7, 8, 9, 10])):
        assert h.tokens(request_id) == expected_completion(prompt, 7, 20)
    assert sched.stats().blocks_reserved == sched.stats().blocks_referenced == 0


def test_a_reservation_that_can_never_fit_is_rejected() -> None:
    tight = Harness(config(num_blocks=7, kv_reservation="max-model-len"))  # 32 tokens need 8 blocks
    with pytest.raises(RequestRejected) as info:
        tight.add("a", [1, 2, 3], max_tokens=1)
    assert info.value.field == "max_tokens" and "kv_reservation=max-model-len" in info.value.reason
    # 5 prompt + 4 output tokens: paged needs blocks for 8 computed tokens (2), the reservation 9 tokens (3).
    for policy, fits in (("paged", True), ("prompt-plus-max-tokens", False)):
        h = Harness(config(num_blocks=2, kv_reservation=policy))
        if fits:
            h.add("a", [1, 2, 3, 4, 5], max_tokens=4, ignore_eos=True)
            h.run()
            assert h.reason("a") is FinishReason.LENGTH
        else:
            with pytest.raises(RequestRejected, match="reserves 3 KV blocks"):
                h.add("a", [1, 2, 3, 4, 5], max_tokens=4, ignore_eos=True)


def test_reset_to_a_pool_too_small_for_the_reservation_fails_the_request() -> None:
    h = Harness(config(kv_reservation="max-model-len", num_blocks=16))
    h.add("a", [1, 2, 3], max_tokens=10, ignore_eos=True)
    h.add("b", [4, 5, 6], max_tokens=10, ignore_eos=True)
    h.step()
    h.collect(h.scheduler.reset_executor(7))
    h.executor = strict_executor(7, 4)
    h.scheduler.check_invariants()
    assert h.reason("a") is FinishReason.ERROR and h.reason("b") is FinishReason.ERROR
    assert not h.scheduler.has_unfinished() and h.scheduler.stats().blocks_reserved == 0
    h.collect(h.scheduler.reset_executor(16))
    h.executor = strict_executor(16, 4)
    h.add("c", [1, 2, 3], max_tokens=10, ignore_eos=True)
    h.run()
    assert h.tokens("c") == expected_completion([1, 2, 3], 7, 10)


def test_broken_reservations_are_caught() -> None:
    h = Harness(config(kv_reservation="max-model-len"))
    h.add("a", [1, 2, 3], max_tokens=10, ignore_eos=True)
    h.step()
    sched = h.scheduler
    sched.view().pool.num_reserved += 1
    with pytest.raises(InvariantError, match="reserved"):
        sched.check_invariants()
    sched.view().pool.num_reserved -= 1
    seq = sched.view().running[0]
    seq.reserved_blocks -= 1
    with pytest.raises(InvariantError, match="reserved"):
        sched.check_invariants()
    seq.reserved_blocks += 1
    sched.check_invariants()
    assert "reserved 7 (max-model-len)" in sched.debug_dump()


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_reservation"):
        SchedulerConfig(num_blocks=8, kv_reservation="contiguous")


def _fields(cfg: SchedulerConfig) -> dict:
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}


def _tokens(h: Harness) -> dict:
    return {key: (c.tokens, c.finish_reason) for key, c in h.completions.items()}
