"""Cross-check against the project's strict FakeExecutor (kvserve.executor.fake.executor).

The FakeExecutor keeps its own shadow KV and block ownership and raises PlanError on
any plan that breaks the step contract; random workloads with aborts, resets, n > 1
and both preemption modes must run to completion with every block returned.
"""

from __future__ import annotations

import random

import pytest

from kvserve.executor.fake import executor as fake_executor
from kvserve.protos.sampling import SamplingParams
from kvserve.scheduler.core.request import RequestRejected
from kvserve.scheduler.core.scheduler import Scheduler
from kvserve.scheduler.core.scheduler_config import SchedulerConfig


@pytest.mark.parametrize("trial", range(16))
def test_random_workload_runs_clean_on_the_fake_executor(trial: int) -> None:
    rng = random.Random(trial)
    block_size = rng.choice([2, 4, 16])
    num_blocks = rng.randrange(8, 40)
    mode = "swap" if trial % 2 else "recompute"
    executor = fake_executor.FakeExecutor(
        fake_executor.FakeExecutorConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            num_cpu_blocks=16,
            max_model_len=128,
            vocab_size=100,
            eos_probability=0.05,
        )
    )
    info = executor.info()
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            num_cpu_blocks=16,
            max_model_len=128,
            max_num_batched_tokens=rng.randrange(4, 64),
            max_num_seqs=rng.randrange(1, 8),
            preemption_mode=mode,
            eos_token_ids=tuple(info.eos_token_ids),
            cache_aware_order=trial % 3 == 0,
            debug_invariants=True,
        )
    )
    added = 0
    rejected: list[str] = []
    finished: set[tuple[str, int]] = set()
    tokens = 0
    for _ in range(2000):
        if added < 10 and rng.random() < 0.3:
            stem = list(range(5, 15))[: rng.randrange(0, 10)]
            prompt = stem + [rng.randrange(100) for _ in range(rng.randrange(1, 20))]
            sampling = SamplingParams(
                max_tokens=rng.randrange(1, 20),
                n=rng.choice([1, 2, 3]),
                seed=rng.choice([None, 5]),
                logprobs=rng.choice([None, 2]),
            )
            try:
                scheduler.add_request(f"r{added}", prompt, sampling)
            except RequestRejected as exc:  # expected: some requests need more KV than a small pool holds
                assert "KV blocks" in exc.reason, exc
                rejected.append(f"r{added}")
            added += 1
        if rng.random() < 0.05 and scheduler.has_unfinished():
            scheduler.abort(rng.choice(list(scheduler.view().requests)))
        if rng.random() < 0.02:
            scheduler.reset_executor()
            executor.reset()
        plan = scheduler.schedule()
        if not plan.is_empty:
            for output in scheduler.update(executor.execute(plan)):
                tokens += len(output.new_token_ids)
                if output.finish_reason is not None:
                    finished.add((output.request_id, output.index))
        if added >= 10 and not scheduler.has_unfinished():
            break
    assert not scheduler.has_unfinished(), scheduler.debug_dump()
    assert scheduler.stats().blocks_referenced == 0
    assert added == 10 and len(rejected) < added, f"every request was rejected: {rejected}"
    ran = {request_id for request_id, _ in finished}
    assert ran and tokens > 0, "no request ran to a finish on the executor"
    assert not ran & set(rejected), "a rejected request produced output"
