"""KV sizing from free memory: the pool fills the budget and no step the scheduler may send runs out.

The runner of the measure stage (the big model, `--gpu-memory-utilization` 0.9, the largest
step `max_num_batched_tokens` tokens over `max_num_seqs` sequences) is started with its
profiling pass observed, so the check knows what the runner knew: the device's total and
free memory before profiling and the activation peak. It then checks

- the arithmetic: blocks = floor((total x utilization - in use - activation peak) / block
  bytes), and the scheduler's `kv-plan` arithmetic (kvserve.scheduler.core.kv_capacity over
  kvserve.protos.kv_geometry) gives the same block count for that budget;
- the fill: after the pool is allocated, memory in use + the activation peak it reserved is
  the utilization of the device, within 2% (nothing left unclaimed, nothing over);
- two stress steps on the real pool: the largest prefill step (the profiled shape) in the
  top blocks, and a decode step of max_num_seqs sequences whose contexts cover every block,
  both without running out of memory (the peak is recorded against the device's total).

On CPU (the rehearsal) the budget is `--kv-cache-gb` and only the arithmetic and stress run.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any
from unittest import mock

import structlog

from kvserve.gpu_check.random_models import model_dir
from kvserve.gpu_check.results import Outcome

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import CheckContext

log = structlog.get_logger(__name__)

FILL_TOLERANCE = 0.02
REHEARSAL_KV_GB = 0.02
_PROFILE_KEY = "kv_profile"


def big_runner(ctx: CheckContext) -> Any:
    """The measure stage's runner (made once; later checks reuse it), its profiling pass recorded."""

    def make() -> Any:
        import torch

        from kvserve.executor.model import profiling_batch
        from kvserve.executor.model_runner import ModelRunner
        from kvserve.executor.runner_config import RunnerConfig

        record: dict[str, Any] = {}
        original = profiling_batch.profile_peak_activation_bytes

        def observed(runner: Any) -> int:
            torch.cuda.synchronize()
            record["free"], record["total"] = torch.cuda.mem_get_info()
            record["peak"] = original(runner)
            return record["peak"]

        scale = ctx.scale
        config = RunnerConfig(
            model=str(model_dir(ctx.work_dir, scale.big_model)),
            device=scale.device,
            max_num_batched_tokens=scale.max_num_batched_tokens,
            max_num_seqs=max(scale.decode_batches),
            kv_cache_gb=None if scale.device.startswith("cuda") else REHEARSAL_KV_GB,
        )
        started = time.perf_counter()
        with mock.patch.object(profiling_batch, "profile_peak_activation_bytes", observed):
            runner = ModelRunner(config)
        record["load_s"] = time.perf_counter() - started
        ctx.state[_PROFILE_KEY] = record
        return runner

    return ctx.resource("big_runner", make, close=lambda runner: runner.close())


def _greedy() -> Any:
    from kvserve.protos.sampling import SamplingParams

    return SamplingParams(temperature=0.0)


def stress_largest_prefill(runner: Any, first_id: int) -> dict[str, Any]:
    """max_num_seqs fresh prompts of max_num_batched_tokens / max_num_seqs tokens in one step,
    in the pool's last blocks."""
    from kvserve.protos.step import NewSequence, StepPlan

    cfg, block_size = runner.config, runner.config.block_size
    seqs = cfg.max_num_seqs
    per_seq = max(1, cfg.max_num_batched_tokens // seqs)
    blocks_each = -(-per_seq // block_size)
    top = runner.cache.num_blocks - seqs * blocks_each
    if top < 0:
        raise RuntimeError(f"the pool ({runner.cache.num_blocks} blocks) cannot hold the largest step")
    rng = random.Random(7)
    vocab = runner.model_config.vocab_size
    new = [
        NewSequence(
            first_id + i,
            [rng.randrange(vocab) for _ in range(per_seq)],
            per_seq,
            0,
            per_seq,
            list(range(top + i * blocks_each, top + (i + 1) * blocks_each)),
            _greedy(),
            i,
        )
        for i in range(seqs)
    ]
    started = time.perf_counter()
    result = runner.execute(StepPlan(step_id=1, new_seqs=new))
    seconds = time.perf_counter() - started
    runner.execute(StepPlan(step_id=2, drop_seq_ids=[s.seq_id for s in new]))
    return {"sequences": seqs, "tokens": seqs * per_seq, "seconds": seconds, "outputs": len(result.outputs)}


def stress_full_pool_decode(runner: Any, first_id: int) -> dict[str, Any]:
    """max_num_seqs sequences whose cached contexts cover every block (up to max_model_len each),
    decoded twice; the second step is timed (the whole pool is read)."""
    from kvserve.gpu_check.timing import synchronize
    from kvserve.protos.step import KnownSequence, NewSequence, StepPlan

    block_size, num_blocks = runner.config.block_size, runner.cache.num_blocks
    seqs = runner.config.max_num_seqs
    blocks_each = min(num_blocks // seqs, runner.max_model_len // block_size)
    known = blocks_each * block_size - 1  # the second step writes the last slot of the last block
    rng = random.Random(11)
    vocab = runner.model_config.vocab_size
    new = []
    for i in range(seqs):
        tokens = [rng.randrange(vocab)] * known  # speed does not depend on the values
        table = list(range(i * blocks_each, (i + 1) * blocks_each))
        new.append(NewSequence(first_id + i, tokens, known, known - 1, 1, table, _greedy(), i))
    first = runner.execute(StepPlan(step_id=3, new_seqs=new))
    sampled = {out.seq_id: out.token_id for out in first.outputs}
    synchronize(runner.device)
    started = time.perf_counter()
    runner.execute(
        StepPlan(step_id=4, known_seqs=[KnownSequence(s.seq_id, [sampled[s.seq_id]], known, 1) for s in new])
    )
    synchronize(runner.device)
    seconds = time.perf_counter() - started
    runner.execute(StepPlan(step_id=5, drop_seq_ids=[s.seq_id for s in new]))
    return {
        "sequences": seqs,
        "context": known + 1,
        "blocks_covered": seqs * blocks_each,
        "blocks_covered_fraction": seqs * blocks_each / num_blocks,
        "step_s": seconds,
    }


def check_kv_sizing(ctx: CheckContext) -> Outcome:
    import torch

    from kvserve.protos.kv_geometry import GIB, KvGeometry
    from kvserve.scheduler.core import plan_kv

    runner = big_runner(ctx)
    cuda = runner.device.startswith("cuda")
    geometry, cache, cfg = runner.geometry, runner.cache, runner.config
    pool_bytes = cache.tensor.numel() * cache.tensor.element_size()
    figures: dict[str, Any] = {
        "num_blocks": cache.num_blocks,
        "block_size": cfg.block_size,
        "bytes_per_block": geometry.bytes_per_block,
        "pool_bytes": pool_bytes,
        "token_capacity": cache.num_blocks * cfg.block_size,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_num_seqs": cfg.max_num_seqs,
    }
    problems = []
    if pool_bytes != cache.num_blocks * geometry.bytes_per_block:
        problems.append(f"pool holds {pool_bytes} bytes, not blocks x bytes per block")
    if cuda:
        record = ctx.state[_PROFILE_KEY]
        total, in_use, peak = record["total"], record["total"] - record["free"], record["peak"]
        budget = total * cfg.gpu_memory_utilization - in_use - peak
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        fill = (total - free_after + peak) / total
        figures.update(
            total_gib=total / GIB,
            in_use_before_gib=in_use / GIB,
            activation_peak_gib=peak / GIB,
            budget_gib=budget / GIB,
            pool_gib=pool_bytes / GIB,
            used_after_gib=(total - free_after) / GIB,
            fill=fill,
            utilization=cfg.gpu_memory_utilization,
            load_s=record["load_s"],
        )
        if abs(fill - cfg.gpu_memory_utilization) > FILL_TOLERANCE:
            problems.append(f"in use + activation peak is {fill:.3f} of the device, not {cfg.gpu_memory_utilization}")
    else:
        budget = (cfg.kv_cache_gb or 0.0) * GIB
        figures["budget_gib"] = budget / GIB
    expected = geometry.blocks_for_bytes(budget)
    kv = KvGeometry(runner.model_config.num_layers, runner.model_config.num_kv_heads, runner.model_config.head_dim)
    planned = plan_kv(kv, int(budget), cfg.block_size, runner.dtype_name, avg_context=1024).num_blocks
    figures.update(expected_blocks=expected, kv_plan_blocks=planned)
    if not expected == planned == cache.num_blocks:
        problems.append(f"blocks: runner {cache.num_blocks}, budget / block bytes {expected}, kv-plan {planned}")

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        figures["largest_step"] = stress_largest_prefill(runner, first_id=1_000_000)
        figures["full_pool_decode"] = stress_full_pool_decode(runner, first_id=2_000_000)
        ctx.state["full_pool_decode"] = figures["full_pool_decode"]
    except torch.cuda.OutOfMemoryError as exc:
        problems.append(f"out of memory under the stress batch: {exc}"[:400])
    if cuda:
        figures["stress_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        figures["stress_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    figures["problems"] = problems
    summary = f"{cache.num_blocks:,} blocks ({pool_bytes / GIB:,.1f} GiB, {figures['token_capacity']:,} tokens)"
    if cuda:
        summary += (
            f"; in use + activation reserve = {figures['fill']:.3f} of the device (target {cfg.gpu_memory_utilization})"
        )
    if "full_pool_decode" in figures:
        p = figures["full_pool_decode"]
        summary += (
            f"; stress: {p['sequences']} x {p['context']:,}-token decode over {p['blocks_covered_fraction']:.0%} "
            "of blocks"
        )
    if problems:
        summary += f"; {problems[0]}"
    return Outcome(not problems, summary, figures, error="\n".join(problems) or None)
