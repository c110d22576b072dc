"""`bench serve` mixed with the 8B-shaped model against HF `generate` static batches (goal >= 6x).

HF runs first, in bf16 on the GPU, before the stage's server claims 90% of the device.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from kvserve.gpu_check.random_models import model_dir
from kvserve.gpu_check.report import Outcome
from kvserve.gpu_check.runner_vs_hf import free_memory, load_hf_model
from kvserve.gpu_check.serve_checks import serve_server

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import StageContext

WORKLOAD = "mixed"
SEED = 0


def _hf_run(ctx: StageContext, workload: Any) -> tuple[Any, int]:
    """(HF's run result, tokens generated): static batches of `hf_batch_size`, the model freed after."""
    import torch

    from kvserve.bench.baseline_hf import requests_from_workload, run_hf_baseline

    device = ctx.sizes.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load_hf_model(model_dir(ctx.work_dir, ctx.sizes.big_model), dtype, device)
    try:
        requests = requests_from_workload(workload)
        return run_hf_baseline(model, requests, batch_size=ctx.sizes.hf_batch_size, progress=False, device=device)
    finally:
        del model
        free_memory()


def measure_bench_serve(ctx: StageContext) -> Outcome:
    from kvserve.bench import workloads as wl
    from kvserve.bench.report import GOALS, compute_ratios, render_table, summarize_run
    from kvserve.bench.serve import BenchConfig, run_serve_benchmark

    sizes, errors = ctx.sizes, []
    vocab = json.loads((model_dir(ctx.work_dir, sizes.big_model) / "config.json").read_text())["vocab_size"]
    (mixed,) = wl.build(WORKLOAD, sizes.bench_requests, vocab, SEED, sizes.bench_max_tokens)
    try:
        hf = _hf_run(ctx, mixed)
    except Exception as exc:
        hf = None
        errors.append(f"hf-generate: {type(exc).__name__}: {exc}"[:400])
    server = serve_server(ctx)
    config = BenchConfig(
        workloads=(WORKLOAD,),
        num_requests=sizes.bench_requests,
        concurrency=sizes.bench_concurrency,
        seed=SEED,
        max_tokens_cap=sizes.bench_max_tokens,
        host=server.target_host,
        port=server.port,
        baselines=(),
        progress=False,
        startup_timeout_s=60.0,
        command_line=f"kvserve gpu_check bench_serve_vs_hf ({sizes.name})",
    )
    report = asyncio.run(run_serve_benchmark(config))
    if hf is not None:
        report.results.append(summarize_run(hf[0]))
        report.meta.update(hf_batch_size=sizes.hf_batch_size, hf_generated_tokens=hf[1], hf_device=sizes.device)
        compute_ratios(report, [], num_blocks=0, block_size=0, max_request_len_by_workload={})
    (ctx.out_dir / "bench_serve_mixed.json").write_text(report.to_json() + "\n")
    (ctx.out_dir / "bench_serve_mixed.txt").write_text(render_table(report) + "\n")
    ours, theirs = report.find("kvserve", WORKLOAD), report.find("hf-generate", WORKLOAD)
    ratio, goal = report.ratios.get("vs_hf_throughput"), GOALS["vs_hf_throughput"][1]
    if ours is None or ours["num_failed"]:
        errors.append(f"kvserve: {ours['num_failed'] if ours else 'no'} failed requests {ours and ours['errors']}")
    kv_tps, hf_tps = (r["output_throughput"] if r else 0.0 for r in (ours, theirs))
    figures = {"workload": WORKLOAD, "requests": sizes.bench_requests, "concurrency": sizes.bench_concurrency}
    figures.update(max_tokens_cap=sizes.bench_max_tokens, hf_batch_size=sizes.hf_batch_size, goal=goal, errors=errors)
    figures.update(kvserve_output_tokens_per_s=kv_tps, hf_output_tokens_per_s=hf_tps, vs_hf_throughput=ratio)
    figures.update(
        kvserve_ttft_mean_s=ours and ours["ttft"]["mean"], report=str(ctx.out_dir / "bench_serve_mixed.json")
    )
    shown = "-" if ratio is None else f"{ratio:.2f}x"
    met = "-" if ratio is None else "met" if ratio >= goal else "not met"
    setting = f"{sizes.bench_requests} requests, concurrency {sizes.bench_concurrency}, "
    setting += f"max_tokens <= {sizes.bench_max_tokens}, HF batch {sizes.hf_batch_size}"
    value = f"{kv_tps:,.0f} vs {hf_tps:,.0f} output tok/s"
    row = ("bench serve mixed: kvserve vs HF generate", setting, value, shown, f">= {goal:g}x: {met}")
    summary = f"vs_hf_throughput {shown} (goal >= {goal:g}): kvserve {kv_tps:,.0f}, HF {hf_tps:,.0f} tok/s"
    summary += f"; {errors[0]}" if errors else ""
    return Outcome(not errors and ratio is not None, summary, figures, [row], error="\n".join(errors) or None)
