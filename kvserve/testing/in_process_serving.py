"""The real scheduler driving an executor in one process, every plan and result through the wire codec.

For tests and benchmarks of what the scheduling core does to a model's output (speculative
decoding, chunking, preemption) without the sockets: the scheduler sizes itself from the
executor's handshake exactly as the service does, and each plan and result is encoded and
decoded as on the link, so a field the codec drops is caught here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.executor.protocol import Executor
from kvserve.protos import step_codec
from kvserve.protos.kvserve.v1 import executor_link_pb2 as pb
from kvserve.protos.sampling import SamplingParams
from kvserve.scheduler.core.draft_proposer import DraftProposer
from kvserve.scheduler.core.outputs import DraftCounts
from kvserve.scheduler.core.scheduler import Scheduler
from kvserve.scheduler.core.scheduler_config import SchedulerConfig


@dataclass(slots=True)
class Served:
    """What a batch of requests produced: tokens per (request id, completion index), and the scheduler."""

    tokens: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    logprobs: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    top_logprobs: dict[tuple[str, int], list[dict[int, float]]] = field(default_factory=dict)
    """Per output position, the requested top tokens' logprobs (token id → logprob), where asked for."""
    drafts: dict[str, DraftCounts] = field(default_factory=dict)
    """Speculative decoding's counts per request (none when it is off)."""
    steps: int = 0
    scheduler: Scheduler | None = None


def serve_in_process(
    executor: Executor,
    requests: dict[str, tuple[list[int], SamplingParams]],
    max_steps: int = 100_000,
    one_at_a_time: bool = False,
    proposer: DraftProposer | None = None,
    **policy: Any,
) -> Served:
    """Run `requests` (id → (prompt, sampling)) to completion under a scheduler with `policy`:
    all queued at once, or each added once the one before has finished (`one_at_a_time`). A
    `proposer` replaces the draft source `policy`'s `speculative` names."""
    info = executor.info()
    config = SchedulerConfig(
        num_blocks=policy.pop("num_blocks", info.num_blocks),
        block_size=info.block_size,
        num_cpu_blocks=info.num_cpu_blocks,
        max_model_len=info.max_model_len,
        eos_token_ids=tuple(info.eos_token_ids),
        **policy,
    )
    scheduler = Scheduler(config, proposer=proposer)
    queue = list(requests.items())
    served = Served(scheduler=scheduler)
    while queue:
        for request_id, (prompt, sampling) in queue[:1] if one_at_a_time else queue:
            scheduler.add_request(request_id, prompt, sampling)
        del queue[: 1 if one_at_a_time else len(queue)]
        _run(executor, scheduler, served, max_steps)
    return served


def _run(executor: Executor, scheduler: Scheduler, served: Served, max_steps: int) -> None:
    """Step until every queued request has finished."""
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        if plan.is_empty:
            raise RuntimeError("the scheduler stalled with unfinished requests")
        sent = step_codec.decode_plan(pb.StepPlan.FromString(step_codec.encode_plan(plan).SerializeToString()))
        result = executor.execute(sent)
        back = step_codec.decode_result(pb.StepResult.FromString(step_codec.encode_result(result).SerializeToString()))
        for out in scheduler.update(back):
            key = (out.request_id, out.index)
            served.tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.logprobs is not None:
                served.logprobs.setdefault(key, []).extend(lp.logprob for lp in out.logprobs)
                served.top_logprobs.setdefault(key, []).extend(
                    {t.token_id: t.logprob for t in lp.top} for lp in out.logprobs
                )
            if out.drafts is not None:
                served.drafts[out.request_id] = out.drafts
        served.steps += 1
        if served.steps >= max_steps:
            raise RuntimeError(f"requests unfinished after {max_steps} steps")
