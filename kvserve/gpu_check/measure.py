"""The measure stage: the device's peaks, figures as fractions of them, KV sizing and CUDA graphs, on one 8B runner."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

from kvserve.bench.executor import bench_prefill, measure_gemm_flops, time_decode
from kvserve.gpu_check.models import SHAPES, free_memory, new_runner
from kvserve.gpu_check.report import Outcome, StageContext, judged
from kvserve.protos.kv_geometry import GIB, KvGeometry, bytes_per_token
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import KnownSequence, NewSequence, StepPlan
from kvserve.scheduler.core import plan_kv
from kvserve.testing.plan_driver import run_prompts

COPY_KEY, GEMM_KEY = "copy_bytes_per_s", "bf16_matmul_flops"
GREEDY = SamplingParams(temperature=0.0)
NO_COPY, NO_GEMM = ["no copy bandwidth measured"], ["no matmul peak measured"]
ATTENTION_GOAL, BLOCK_SIZE = 0.70, 16
FILL_TOLERANCE = 0.02
REHEARSAL_KV_GB = 0.02
# CUDA graphs on CPU: the toy model on the Triton backend (interpreted), which is what the graphs run on
REHEARSAL_GRAPH_RUNNER = dict(attention_backend="triton", kv_cache_gb=REHEARSAL_KV_GB, max_model_len=256)
GRAPH_NEW_TOKENS, GRAPH_PROMPT_LEN = 8, 64  # short prompts: their prefills cost little beside the timed decode


def seconds_per_call(fn: Callable[[int], object], iterations: int, device: str, warmup: int = 3) -> float:
    """Mean seconds of `fn(i)` over back-to-back calls (CUDA events on the GPU: launches overlap)."""
    import torch

    for i in range(warmup):
        fn(i)
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    started = time.perf_counter()
    for i in range(iterations):
        fn(i)
    if device != "cuda":
        return (time.perf_counter() - started) / iterations
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0 / iterations


def _fraction(value: float | None, of: str) -> str:
    return "-" if value is None else f"{value:.0%} of {of}"


def measure_device_peaks(ctx: StageContext) -> Outcome:
    """The yardsticks: copy bandwidth (read + write bytes/s, an HBM-bound kernel's ceiling) and the bf16 matmul peak."""
    import torch

    device, sizes = ctx.sizes.device, ctx.sizes
    src = torch.empty(sizes.copy_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy = ctx.state[COPY_KEY] = 2 * sizes.copy_bytes / seconds_per_call(lambda _i: dst.copy_(src), 10, device)
    gemm = ctx.state[GEMM_KEY] = measure_gemm_flops(device, torch.bfloat16, size=sizes.gemm_size, repeats=10)
    figures = {COPY_KEY: copy, GEMM_KEY: gemm, "copy_bytes": sizes.copy_bytes, "gemm_size": sizes.gemm_size}
    copied = f"{sizes.copy_bytes / 2**30:g} GiB, read + write"
    rows = [("device copy bandwidth", copied, f"{copy / 1e9:,.0f} GB/s", "-", "-")]
    rows.append(("bf16 matmul peak", f"{sizes.gemm_size}^3 matmul", f"{gemm / 1e12:,.0f} TFLOP/s", "-", "-"))
    return Outcome(True, f"copy {copy / 1e9:,.0f} GB/s, bf16 matmul {gemm / 1e12:,.1f} TFLOP/s", figures, rows)


def attention_point(batch: int, context: int, heads: tuple[int, int, int], device: str, min_pool: int) -> dict:
    """Seconds per call and K/V bytes/s at one point, cycling through block sets of a pool past L2 (not from cache)."""
    import torch

    from kvserve.kernels.paged_decode import paged_decode_attention

    num_heads, kv_heads, head_dim = heads
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    blocks_each, token_bytes = -(-context // BLOCK_SIZE), kv_heads * head_dim * 2 * dtype.itemsize
    kv_bytes = batch * context * token_bytes
    sets = max(1, -(-min_pool // (batch * blocks_each * BLOCK_SIZE * token_bytes)))
    gen = torch.Generator(device=device).manual_seed(batch * 100_003 + context)
    shape = (sets * batch * blocks_each, BLOCK_SIZE, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in "kv")
    tables = torch.randperm(shape[0], device=device, generator=gen).to(torch.int32).view(sets, batch, blocks_each)
    query = torch.randn(batch, num_heads, head_dim, device=device, dtype=dtype, generator=gen)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    out = torch.empty_like(query)

    def call(i: int) -> None:
        paged_decode_attention(query, k_cache, v_cache, tables[i % sets], seq_lens, head_dim**-0.5, out=out)

    iterations = max(sets, 20 if kv_bytes < 2**30 else 10) if device == "cuda" else 2
    seconds = seconds_per_call(call, iterations, device)
    return {"batch": batch, "context": context, "seconds": seconds, "kv_bytes_per_s": kv_bytes / seconds}


def attention(ctx: StageContext) -> Outcome:
    """The paged decode kernel on one layer of the big model, as the runner calls it: K/V bytes/s against copy BW."""
    sizes, copy = ctx.sizes, ctx.state.get(COPY_KEY)
    c = SHAPES[sizes.big_model]["config"]
    heads = (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
    points, rows = [], []
    for context in sizes.attention_contexts:
        for batch in sizes.attention_batches:
            p = attention_point(batch, context, heads, sizes.device, sizes.attention_min_pool_bytes)
            free_memory()
            share = p["fraction_of_copy"] = p["kv_bytes_per_s"] / copy if copy else None
            p["goal_met"] = bool(share and share >= ATTENTION_GOAL)
            points.append(p)
            speed = f"{p['kv_bytes_per_s'] / 1e9:,.0f} GB/s ({p['seconds'] * 1e6:,.0f} us)"
            goal = f">= {ATTENTION_GOAL:.0%}: {'met' if p['goal_met'] else 'not met'}"
            setting = f"context {context:,}, batch {batch}"
            rows.append(("paged decode attention (Triton), K/V read", setting, speed, _fraction(share, "copy"), goal))
    met, best = sum(p["goal_met"] for p in points), max(points, key=lambda p: p["kv_bytes_per_s"])
    summary = f"{met}/{len(points)} points at >= {ATTENTION_GOAL:.0%} of copy bandwidth; "
    summary += f"best {best['kv_bytes_per_s'] / 1e9:,.1f} GB/s at context {best['context']}, batch {best['batch']}"
    figures = dict(heads=heads, block_size=BLOCK_SIZE, copy_bytes_per_s=copy, goal_fraction=ATTENTION_GOAL)
    return judged(summary, {**figures, "points": points}, [] if copy else NO_COPY, rows)


def big_runner(ctx: StageContext) -> Any:
    """The measure stage's runner, shared by its checks; `state["kv_profile"]` records its profiling pass."""

    def make() -> Any:
        import torch

        from kvserve.executor.model import profiling_batch

        free_memory()  # what earlier checks left in torch's cache must not count as in use
        record, original = ctx.state.setdefault("kv_profile", {}), profiling_batch.profile_peak_activation_bytes

        def observed(runner: Any) -> int:
            torch.cuda.synchronize()
            record["free"], record["total"] = torch.cuda.mem_get_info()
            record["peak"] = original(runner)
            return record["peak"]

        sizes, started = ctx.sizes, time.perf_counter()
        config = dict(max_num_batched_tokens=sizes.max_num_batched_tokens, max_num_seqs=max(sizes.decode_batches))
        with mock.patch.object(profiling_batch, "profile_peak_activation_bytes", observed):
            runner = new_runner(ctx, kv_cache_gb=None if sizes.device == "cuda" else REHEARSAL_KV_GB, **config)
        record["load_s"] = time.perf_counter() - started
        return runner

    return ctx.shared("big_runner", make)


def stress_steps(runner: Any, device: str) -> dict[str, Any]:
    """The largest prefill step in the pool's top blocks, then a timed decode of max_num_seqs sequences on all of it."""
    block_size, num_blocks, seqs = runner.config.block_size, runner.cache.num_blocks, runner.config.max_num_seqs
    rng, vocab = random.Random(7), runner.model_config.vocab_size

    def new_seqs(length: int, cached: int, first_block: int, each: int) -> list[Any]:
        blocks = [list(range(first_block + i * each, first_block + (i + 1) * each)) for i in range(seqs)]
        tokens = [[rng.randrange(vocab) for _ in range(length)] for _ in range(seqs)]
        return [NewSequence(i, tokens[i], length, cached, length - cached, blocks[i], GREEDY, i) for i in range(seqs)]

    def timed(plan: StepPlan) -> float:
        return seconds_per_call(lambda _i: runner.execute(plan), 1, device, warmup=0)

    per_seq = max(1, runner.config.max_num_batched_tokens // seqs)
    each = -(-per_seq // block_size)
    if num_blocks < seqs * each:
        raise RuntimeError(f"the pool ({num_blocks} blocks) cannot hold the largest step")
    new = new_seqs(per_seq, 0, num_blocks - seqs * each, each)
    largest = {"sequences": seqs, "tokens": seqs * per_seq, "seconds": timed(StepPlan(step_id=1, new_seqs=new))}
    runner.execute(StepPlan(step_id=2, drop_seq_ids=[s.seq_id for s in new]))
    each = min(num_blocks // seqs, runner.max_model_len // block_size)
    known = each * block_size - 1  # the decode step writes the last slot of the last block
    new = new_seqs(known, known - 1, 0, each)
    sampled = {out.seq_id: out.token_id for out in runner.execute(StepPlan(step_id=3, new_seqs=new)).outputs}
    decode = [KnownSequence(s.seq_id, [sampled[s.seq_id]], known, 1) for s in new]
    step_s = timed(StepPlan(step_id=4, known_seqs=decode))
    runner.execute(StepPlan(step_id=5, drop_seq_ids=[s.seq_id for s in new]))
    full = dict(sequences=seqs, context=known + 1, blocks_covered_fraction=seqs * each / num_blocks, step_s=step_s)
    return {"largest_step": largest, "full_pool_decode": full}


def check_kv_sizing(ctx: StageContext) -> Outcome:
    """The pool sized from free memory agrees with the observed profile and `kv-plan`; the largest steps fit in it."""
    import torch

    runner = big_runner(ctx)
    cuda, cache, cfg, mc = runner.device.startswith("cuda"), runner.cache, runner.config, runner.model_config
    pool_bytes = cache.tensor.numel() * cache.tensor.element_size()
    figures: dict[str, Any] = dict(num_blocks=cache.num_blocks, block_size=cfg.block_size, pool_gib=pool_bytes / GIB)
    problems = []
    if pool_bytes != cache.num_blocks * runner.geometry.bytes_per_block:
        problems.append(f"the pool holds {pool_bytes} bytes, not blocks x bytes per block")
    budget = (cfg.kv_cache_gb or 0.0) * GIB
    summary = f"{cache.num_blocks:,} blocks ({pool_bytes / GIB:,.1f} GiB, {cache.num_blocks * cfg.block_size:,} tokens)"
    if cuda:
        record, utilization = ctx.state["kv_profile"], cfg.gpu_memory_utilization
        total, in_use, peak = record["total"], record["total"] - record["free"], record["peak"]
        budget = total * utilization - in_use - peak
        torch.cuda.synchronize()
        fill = (total - torch.cuda.mem_get_info()[0] + peak) / total
        figures.update(total_gib=total / GIB, in_use_before_gib=in_use / GIB, activation_peak_gib=peak / GIB)
        figures.update(fill=fill, utilization=utilization, load_s=record["load_s"])
        summary += f"; in use + activation reserve = {fill:.3f} of the device"
        if abs(fill - utilization) > FILL_TOLERANCE:
            problems.append(f"in use + activation peak is {fill:.3f} of the device, not {utilization}")
    expected = runner.geometry.blocks_for_bytes(budget)
    geometry = KvGeometry(mc.num_layers, mc.num_kv_heads, mc.head_dim)
    planned = plan_kv(geometry, int(budget), cfg.block_size, runner.dtype_name, avg_context=1024).num_blocks
    figures.update(budget_gib=budget / GIB, expected_blocks=expected, kv_plan_blocks=planned)
    if not expected == planned == cache.num_blocks:
        problems.append(f"blocks: runner {cache.num_blocks}, budget / block bytes {expected}, kv-plan {planned}")
    torch.cuda.reset_peak_memory_stats() if cuda else None
    try:
        figures.update(stress_steps(runner, ctx.sizes.device))
        ctx.state["full_pool_decode"] = p = figures["full_pool_decode"]
        stress = f"; {p['sequences']} x {p['context']:,}-token decode over {p['blocks_covered_fraction']:.0%} of blocks"
        summary += "" if problems else stress
    except torch.cuda.OutOfMemoryError as exc:
        problems.append(f"out of memory under the stress steps: {exc}"[:400])
    figures.update(stress_peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB if cuda else None, problems=problems)
    return judged(summary, figures, problems)


def measure_decode(ctx: StageContext) -> Outcome:
    """Decode tok/s per batch and over the whole pool; memory-bound: weights + cached K/V per step against copy BW."""
    sizes, runner, copy = ctx.sizes, big_runner(ctx), ctx.state.get(COPY_KEY)
    c, element, prompt_len = runner.model_config, runner.cache.tensor.element_size(), sizes.decode_prompt_len
    kv_token = bytes_per_token(KvGeometry(c.num_layers, c.num_kv_heads, c.head_dim), runner.dtype_name)
    embedding = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size  # a lookup: only `batch` rows read
    # the context is the first timed step's: later steps read a few more tokens (a lower bound)
    timed: list[tuple[int, int, str, float | None]] = [(b, prompt_len + 2, "", None) for b in sizes.decode_batches]
    if full := ctx.state.get("full_pool_decode"):
        timed.append((full["sequences"], full["context"] - 1, " (whole KV pool)", full["step_s"]))
    points, rows = [], []
    for i, (batch, context, note, measured) in enumerate(timed):
        step_s = measured or time_decode(runner, batch, prompt_len, sizes.decode_steps, GREEDY, (i + 1) * 100_000)[0]
        step_bytes = (c.num_params - embedding + batch * c.hidden_size) * element + batch * (context + 1) * kv_token
        share, tps = step_bytes / step_s / copy if copy else None, batch / step_s
        points.append(dict(batch=batch, context=context, tokens_per_s=tps, step_s=step_s, fraction_of_copy=share))
        speed, setting = f"{tps:,.0f} tok/s ({step_s * 1e3:.2f} ms/step)", f"batch {batch}, context {context:,}{note}"
        rows.append((f"decode, {sizes.big_model}", setting, speed, _fraction(share, "copy BW"), "-"))
    summary = "; ".join(
        f"B={p['batch']}: {p['tokens_per_s']:,.0f} tok/s ({_fraction(p['fraction_of_copy'], 'copy')})" for p in points
    )
    figures = {COPY_KEY: copy, "decode_steps": sizes.decode_steps, "points": points}
    return judged(summary, figures, [] if copy else NO_COPY, rows)


def measure_prefill(ctx: StageContext) -> Outcome:
    """Prefill tok/s per shape; compute-bound: its FLOPs (matmuls, lm_head rows, attention) against the matmul peak."""
    runner, gemm = big_runner(ctx), ctx.state.get(GEMM_KEY)
    c = runner.model_config
    table = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)  # embedding + lm_head
    points, rows = [], []
    for i, (seqs, prompt_len) in enumerate(ctx.sizes.prefill_shapes):
        tps = bench_prefill(runner, seqs, prompt_len, repeats=2, seq_base=(60 + i) * 100_000)
        attention = 4.0 * c.num_layers * c.num_heads * c.head_dim * seqs * prompt_len * (prompt_len + 1) / 2
        flops = 2.0 * (c.num_params - table) * seqs * prompt_len + 2.0 * c.vocab_size * c.hidden_size * seqs + attention
        share = flops * tps / (seqs * prompt_len) / gemm if gemm else None
        points.append(dict(sequences=seqs, prompt_len=prompt_len, tokens_per_s=tps, fraction_of_matmul_peak=share))
        value, shown = f"{tps:,.0f} tok/s", _fraction(share, "bf16 matmul peak")
        rows.append((f"prefill, {ctx.sizes.big_model}", f"{seqs} x {prompt_len:,} tokens", value, shown, "-"))
    summary = "; ".join(f"{r[1]}: {r[2]} ({r[3]})" for r in rows)
    return judged(summary, {GEMM_KEY: gemm, "points": points}, [] if gemm else NO_GEMM, rows)


def measure_cuda_graphs(ctx: StageContext) -> Outcome:
    """CUDA graphs of the decode step: used, faster than eager, and the same greedy tokens (a full bucket's graph runs
    eager's kernels on eager's shapes). The CPU rehearsal captures nothing (`capture=False`): the plumbing only."""
    from kvserve.executor.model.cuda_graphs import CudaDecodeGraphs

    sizes, on_gpu, buckets = ctx.sizes, ctx.sizes.device == "cuda", ctx.sizes.graph_batches
    config = dict(REHEARSAL_GRAPH_RUNNER, max_num_seqs=max(buckets))
    runner = big_runner(ctx) if on_gpu else ctx.shared("graphs_runner", lambda: new_runner(ctx, **config))
    started, width = time.perf_counter(), -(-runner.max_model_len // runner.config.block_size)
    graphs = CudaDecodeGraphs(runner.model, runner.cache, runner.backend, buckets, width, capture=on_gpu)
    graphs.capture_all()
    capture_s, prompt_len = time.perf_counter() - started, sizes.decode_prompt_len
    points, rows = [], []
    try:
        for i, batch in enumerate(buckets):
            rng, vocab = random.Random(batch), runner.model_config.vocab_size
            prompts = [[rng.randrange(vocab) for _ in range(GRAPH_PROMPT_LEN)] for _ in range(batch)]
            runner.graphs = None
            eager_s = time_decode(runner, batch, prompt_len, sizes.decode_steps, GREEDY, (80 + i) * 100_000)[0]
            eager_tokens = run_prompts(runner, prompts, GRAPH_NEW_TOKENS)
            runner.graphs, before = graphs, graphs.replays
            graph_s = time_decode(runner, batch, prompt_len, sizes.decode_steps, GREEDY, (90 + i) * 100_000)[0]
            graph_tokens = run_prompts(runner, prompts, GRAPH_NEW_TOKENS)
            used, identical = graphs.replays > before, sum(graph_tokens[s] == eager_tokens[s] for s in eager_tokens)
            points.append(dict(batch=batch, eager_step_s=eager_s, graph_step_s=graph_s, used=used, identical=identical))
            speed = f"{eager_s * 1e3:.2f} -> {graph_s * 1e3:.2f} ms/step ({eager_s / graph_s:.2f}x)"
            tokens = f"{identical}/{batch} identical greedy sequences"
            rows.append(("decode step, CUDA graphs vs eager", f"batch {batch}", speed, "-", tokens))
    finally:
        runner.graphs = None
        del graphs
        free_memory()
    passed = all(p["used"] and p["identical"] == p["batch"] for p in points)
    how = "captured" if on_gpu else "rehearsed without capture"
    summary = f"{how}, {len(buckets)} buckets in {capture_s:.1f} s; " + "; ".join(
        f"B={p['batch']}: {p['eager_step_s'] / p['graph_step_s']:.2f}x eager's speed, "
        f"{p['identical']}/{p['batch']} identical" + ("" if p["used"] else ", NOT USED")
        for p in points
    )
    error = None if passed else "a bucket was not used, or its greedy tokens differ from eager's"
    return Outcome(passed, summary, dict(capture_s=capture_s, points=points), rows, error)
