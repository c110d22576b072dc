"""Property tests: random interleavings of add, step, in-flight abort, finish and executor reset.

Tiny pools force preemption (both modes) and eviction. The strict fake executor checks every
plan against the KV slots; `check_invariants()` runs after every operation; each
completion's tokens must equal an undisturbed run's; at the end every block is free or
cached, nothing is referenced or reserved, and every request gave back each block reference
it took. Each `kv_reservation` policy gets its own run of examples.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.executor.fake.tokens import expected_completion
from kvserve.protos.stop_rules import FinishReason
from kvserve.scheduler.core.request import RequestRejected, derive_seed
from kvserve.scheduler.core.scheduler_config import KV_RESERVATIONS, SchedulerConfig
from tests.scheduler.harness import Harness, strict_executor

MAX_EXAMPLES = int(os.environ.get("KVSERVE_PROPERTY_EXAMPLES", "150"))
"""Raise it for a longer local hunt, e.g. KVSERVE_PROPERTY_EXAMPLES=3000."""

OPS = ("add", "add", "add", "add", "step", "step", "step", "abort", "abort_in_flight", "finish", "reset")


@st.composite
def configs(draw, kv_reservation: str) -> SchedulerConfig:
    block_size = draw(st.sampled_from([1, 2, 4]))
    # Tight: a few requests of up to ~20 tokens; reserving max_model_len (24) needs room for one at least.
    kv_tokens = draw(st.integers(10 if kv_reservation == "paged" else 24, 40 if kv_reservation == "paged" else 60))
    return SchedulerConfig(
        kv_reservation=kv_reservation,
        num_blocks=-(-kv_tokens // block_size),
        block_size=block_size,
        num_cpu_blocks=draw(st.sampled_from([0, 4, 12, 40])),
        max_model_len=24,
        max_num_batched_tokens=draw(st.integers(1, 12)),
        max_num_seqs=draw(st.integers(1, 6)),
        preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
        enable_prefix_caching=draw(st.booleans()),
        cache_aware_order=draw(st.booleans()),
        eos_token_ids=draw(st.sampled_from([(), (0,), (3, 4)])),
        cache_aware_max_skips=draw(st.integers(0, 3)),
    )


def random_request(rng: random.Random, h: Harness, request_id: str, prompts: dict, seeds: dict) -> None:
    # A 3-letter alphabet and shared stems make prefix hits and partial-block matches common.
    stem = [1, 2, 1, 2, 1, 2, 1, 2][: rng.randrange(0, 9)]
    prompt = stem + [rng.randrange(3) for _ in range(rng.randrange(1 if not stem else 0, 8))]
    seed = rng.randrange(1000)
    try:
        h.add(
            request_id,
            prompt,
            max_tokens=rng.randrange(1, 12),
            n=rng.choice([1, 1, 2, 3]),
            seed=seed,
            ignore_eos=rng.random() < 0.5,
            min_tokens=rng.choice([0, 0, 1]),
            stop_token_ids=rng.choice([(), (7,)]),
            priority=rng.randrange(3),
            namespace=rng.choice(["a", "b"]),
            arrival_time=rng.random(),
        )
    except RequestRejected as exc:
        assert exc.field in ("max_tokens", "prompt")
        return
    prompts[request_id], seeds[request_id] = prompt, seed


@pytest.mark.parametrize("kv_reservation", KV_RESERVATIONS)
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), ops=st.lists(st.sampled_from(OPS), min_size=4, max_size=60), seed=st.integers(0, 2**32))
def test_random_interleavings_keep_every_invariant(kv_reservation: str, data, ops: list[str], seed: int) -> None:
    config = data.draw(configs(kv_reservation), label="config")
    rng = random.Random(seed)
    h = Harness(config)
    sched = h.scheduler
    prompts: dict[str, list[int]] = {}
    seeds: dict[str, int] = {}
    for number, op in enumerate(ops):
        live = list(sched.view().requests)
        if op == "add":
            random_request(rng, h, f"r{number}", prompts, seeds)
        elif op == "step":
            h.step()
        elif op == "abort" and live:
            victim = rng.choice(live)
            h.collect(sched.abort(victim))
        elif op == "abort_in_flight":
            plan = h.schedule()
            if live:
                h.collect(sched.abort(rng.choice(live)))
            sched.check_invariants()
            if not plan.is_empty:
                h.finish_step(plan)
        elif op == "finish" and live:
            request = sched.request(rng.choice(live))
            out = sched.finish_sequence(request.request_id, rng.randrange(len(request.seqs)))
            if out is not None:
                h.collect([out])
        elif op == "reset":
            plan = h.schedule()  # lost with the executor
            new_size = rng.choice([None, config.num_blocks, config.num_blocks + 2])
            h.collect(sched.reset_executor(new_size))
            size = sched.stats().num_blocks
            h.executor = strict_executor(size, config.block_size, config.num_cpu_blocks, h.vocab_size)
            if not plan.is_empty:
                h.collect(sched.update(_result_for(plan)))  # a late result for the lost plan: ignored
        sched.check_invariants()
    h.run(max_steps=3000)
    sched.check_invariants()
    stats = sched.stats()
    assert stats.blocks_referenced == stats.blocks_reserved == 0
    assert stats.blocks_free + stats.blocks_cached == stats.num_blocks
    assert stats.cpu_blocks_used == 0 and stats.num_running == stats.num_waiting == stats.num_swapped == 0
    for (request_id, index), completion in h.completions.items():
        assert completion.finish_reason is not None
        counts = completion.outputs[-1].blocks
        assert counts is not None and counts.allocated + counts.hit - counts.copied == counts.freed
        if request_id not in prompts:
            continue
        expected = expected_completion(
            prompts[request_id], derive_seed(seeds[request_id], index), len(completion.tokens), h.vocab_size
        )
        assert completion.tokens == expected
        if completion.finish_reason is FinishReason.LENGTH:
            assert len(completion.tokens) <= 24


def _result_for(plan):
    from kvserve.protos.step import StepResult

    return StepResult(plan.step_id)
