"""KV sizing from free memory: the pool fills the budget, and no step the scheduler may send runs out.

The runner's profiling pass is observed, so the block count can be checked against (total x
utilization - in use - activation peak) / block bytes and the scheduler's `kv-plan` arithmetic
(kvserve.protos.kv_geometry); then the largest step and a decode over every block must fit.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any
from unittest import mock

from kvserve.gpu_check.random_models import model_dir
from kvserve.gpu_check.report import Outcome

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import StageContext

FILL_TOLERANCE = 0.02
REHEARSAL_KV_GB = 0.02


def big_runner(ctx: StageContext) -> Any:
    """The measure stage's runner, shared by its checks; `state["kv_profile"]` records its profiling pass."""

    def make() -> Any:
        import torch

        from kvserve.executor.model import profiling_batch
        from kvserve.executor.model_runner import ModelRunner
        from kvserve.executor.runner_config import RunnerConfig

        record: dict[str, Any] = ctx.state.setdefault("kv_profile", {})
        original = profiling_batch.profile_peak_activation_bytes

        def observed(runner: Any) -> int:
            torch.cuda.synchronize()
            record["free"], record["total"] = torch.cuda.mem_get_info()
            record["peak"] = original(runner)
            return record["peak"]

        sizes = ctx.sizes
        config = RunnerConfig(
            model=str(model_dir(ctx.work_dir, sizes.big_model)),
            device=sizes.device,
            max_num_batched_tokens=sizes.max_num_batched_tokens,
            max_num_seqs=max(sizes.decode_batches),
            kv_cache_gb=None if sizes.device == "cuda" else REHEARSAL_KV_GB,
        )
        started = time.perf_counter()
        with mock.patch.object(profiling_batch, "profile_peak_activation_bytes", observed):
            runner = ModelRunner(config)
        record["load_s"] = time.perf_counter() - started
        return runner

    return ctx.shared("big_runner", make, close=lambda runner: runner.close())


def _timed(runner: Any, plan: Any) -> tuple[Any, float]:
    import torch

    torch.cuda.synchronize() if runner.device.startswith("cuda") else None
    started = time.perf_counter()
    result = runner.execute(plan)
    torch.cuda.synchronize() if runner.device.startswith("cuda") else None
    return result, time.perf_counter() - started


def stress_steps(runner: Any) -> dict[str, Any]:
    """The largest prefill step in the pool's top blocks; then max_num_seqs sequences whose contexts cover
    every block (up to max_model_len each), and a decode step over them all, timed."""
    from kvserve.protos.sampling import SamplingParams
    from kvserve.protos.step import KnownSequence, NewSequence, StepPlan

    block_size, num_blocks, seqs = runner.config.block_size, runner.cache.num_blocks, runner.config.max_num_seqs
    rng, vocab, greedy = random.Random(7), runner.model_config.vocab_size, SamplingParams(temperature=0.0)
    per_seq = max(1, runner.config.max_num_batched_tokens // seqs)
    each = -(-per_seq // block_size)
    top = num_blocks - seqs * each
    if top < 0:
        raise RuntimeError(f"the pool ({num_blocks} blocks) cannot hold the largest step")
    new = [
        NewSequence(i, [rng.randrange(vocab) for _ in range(per_seq)], per_seq, 0, per_seq, blocks, greedy, i)
        for i, blocks in enumerate(list(range(top + i * each, top + (i + 1) * each)) for i in range(seqs))
    ]
    largest_s = _timed(runner, StepPlan(step_id=1, new_seqs=new))[1]
    runner.execute(StepPlan(step_id=2, drop_seq_ids=[s.seq_id for s in new]))
    each = min(num_blocks // seqs, runner.max_model_len // block_size)
    known = each * block_size - 1  # the decode step writes the last slot of the last block
    new = [
        NewSequence(
            i, [rng.randrange(vocab)] * known, known, known - 1, 1, list(range(i * each, (i + 1) * each)), greedy, i
        )
        for i in range(seqs)
    ]
    sampled = {out.seq_id: out.token_id for out in runner.execute(StepPlan(step_id=3, new_seqs=new)).outputs}
    decode = [KnownSequence(s.seq_id, [sampled[s.seq_id]], known, 1) for s in new]
    step_s = _timed(runner, StepPlan(step_id=4, known_seqs=decode))[1]
    runner.execute(StepPlan(step_id=5, drop_seq_ids=[s.seq_id for s in new]))
    full = dict(sequences=seqs, context=known + 1, blocks_covered_fraction=seqs * each / num_blocks, step_s=step_s)
    return {
        "largest_step": {"sequences": seqs, "tokens": seqs * per_seq, "seconds": largest_s},
        "full_pool_decode": full,
    }


def check_kv_sizing(ctx: StageContext) -> Outcome:
    import torch

    from kvserve.protos.kv_geometry import GIB, KvGeometry
    from kvserve.scheduler.core import plan_kv

    runner = big_runner(ctx)
    cuda, cache, cfg, mc = runner.device.startswith("cuda"), runner.cache, runner.config, runner.model_config
    pool_bytes = cache.tensor.numel() * cache.tensor.element_size()
    figures: dict[str, Any] = dict(num_blocks=cache.num_blocks, block_size=cfg.block_size, pool_gib=pool_bytes / GIB)
    problems = []
    if pool_bytes != cache.num_blocks * runner.geometry.bytes_per_block:
        problems.append(f"the pool holds {pool_bytes} bytes, not blocks x bytes per block")
    budget = (cfg.kv_cache_gb or 0.0) * GIB
    if cuda:
        record, utilization = ctx.state["kv_profile"], cfg.gpu_memory_utilization
        total, in_use, peak = record["total"], record["total"] - record["free"], record["peak"]
        budget = total * utilization - in_use - peak
        torch.cuda.synchronize()
        fill = (total - torch.cuda.mem_get_info()[0] + peak) / total
        figures.update(total_gib=total / GIB, in_use_before_gib=in_use / GIB, activation_peak_gib=peak / GIB)
        figures.update(fill=fill, utilization=utilization, load_s=record["load_s"])
        if abs(fill - utilization) > FILL_TOLERANCE:
            problems.append(f"in use + activation peak is {fill:.3f} of the device, not {utilization}")
    expected = runner.geometry.blocks_for_bytes(budget)
    geometry = KvGeometry(mc.num_layers, mc.num_kv_heads, mc.head_dim)
    planned = plan_kv(geometry, int(budget), cfg.block_size, runner.dtype_name, avg_context=1024).num_blocks
    figures.update(budget_gib=budget / GIB, expected_blocks=expected, kv_plan_blocks=planned)
    if not expected == planned == cache.num_blocks:
        problems.append(f"blocks: runner {cache.num_blocks}, budget / block bytes {expected}, kv-plan {planned}")
    torch.cuda.reset_peak_memory_stats() if cuda else None
    stress = ""
    try:
        figures.update(stress_steps(runner))
        ctx.state["full_pool_decode"] = p = figures["full_pool_decode"]
        stress = f"; {p['sequences']} x {p['context']:,}-token decode over {p['blocks_covered_fraction']:.0%} of blocks"
    except torch.cuda.OutOfMemoryError as exc:
        problems.append(f"out of memory under the stress steps: {exc}"[:400])
    figures.update(stress_peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB if cuda else None, problems=problems)
    summary = f"{cache.num_blocks:,} blocks ({pool_bytes / GIB:,.1f} GiB, {cache.num_blocks * cfg.block_size:,} tokens)"
    summary += (f"; in use + activation reserve = {fill:.3f} of the device" if cuda else "") + (
        stress if not problems else ""
    )
    summary += f"; {problems[0]}" if problems else ""
    return Outcome(not problems, summary, figures, error="\n".join(problems) or None)
