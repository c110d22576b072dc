"""`bench serve` on `mixed` with the 8B-shaped model on CUDA, against HF `generate` static batching.

The same seeded requests both ways (kvserve.bench.workloads), the same ratio as `kvserve bench
serve` reports (`vs_hf_throughput`: output tokens/s, goal >= 6). HF runs first, in this
process, in bf16 on the GPU (`kvserve bench serve --baselines hf` would load it in fp32 on
CPU), before the stage's server claims 90% of the device; then `bench serve` drives that
server (kvserve.bench.serve, against a running server, no other baseline). Both
reports are written beside report.json: bench_serve_mixed.json and .txt.
"""

from __future__ import annotations

import asyncio
import gc
import json
from typing import TYPE_CHECKING, Any

import structlog

from kvserve.gpu_check.random_models import model_dir
from kvserve.gpu_check.results import Outcome
from kvserve.gpu_check.serve_checks import serve_server

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import CheckContext

log = structlog.get_logger(__name__)

WORKLOAD = "mixed"
SEED = 0


def _hf_run(ctx: CheckContext, workload: Any) -> tuple[Any, int]:
    import torch

    from kvserve.bench.baseline_hf import requests_from_workload, run_hf_baseline
    from kvserve.gpu_check.hf_reference import load_hf_model

    device = ctx.scale.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = load_hf_model(model_dir(ctx.work_dir, ctx.scale.big_model), dtype, device)
    try:
        return run_hf_baseline(
            model, requests_from_workload(workload), batch_size=ctx.scale.hf_batch_size, progress=False, device=device
        )
    finally:
        del model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def measure_bench_serve(ctx: CheckContext) -> Outcome:
    from kvserve.bench import workloads as wl
    from kvserve.bench.report import GOALS, compute_ratios, render_table, summarize_run
    from kvserve.bench.serve import BenchConfig, run_serve_benchmark

    scale = ctx.scale
    config_path = model_dir(ctx.work_dir, scale.big_model) / "config.json"
    vocab = json.loads(config_path.read_text())["vocab_size"]
    (mixed,) = wl.build(WORKLOAD, scale.bench_requests, vocab, SEED, scale.bench_max_tokens)
    errors: list[str] = []
    hf = None
    try:
        hf = _hf_run(ctx, mixed)
    except Exception as exc:
        errors.append(f"hf-generate: {type(exc).__name__}: {exc}"[:400])
    server = serve_server(ctx)
    config = BenchConfig(
        workloads=(WORKLOAD,),
        num_requests=scale.bench_requests,
        concurrency=scale.bench_concurrency,
        seed=SEED,
        max_tokens_cap=scale.bench_max_tokens,
        start_server=False,
        host=server.target_host,
        port=server.port,
        baselines=(),
        hf_batch_size=scale.hf_batch_size,
        progress=False,
        startup_timeout_s=60.0,
        command_line=f"kvserve gpu_check bench_serve_vs_hf ({scale.name})",
    )
    report = asyncio.run(run_serve_benchmark(config))
    if hf is not None:
        report.results.append(summarize_run(hf[0]))
        report.meta.update(hf_batch_size=scale.hf_batch_size, hf_generated_tokens=hf[1], hf_device=scale.device)
        compute_ratios(report, [], num_blocks=0, block_size=0, max_request_len_by_workload={})
    (ctx.out_dir / "bench_serve_mixed.json").write_text(report.to_json() + "\n")
    (ctx.out_dir / "bench_serve_mixed.txt").write_text(render_table(report) + "\n")
    ours = report.find("kvserve", WORKLOAD)
    theirs = report.find("hf-generate", WORKLOAD)
    ratio = report.ratios.get("vs_hf_throughput")
    goal = GOALS["vs_hf_throughput"][1]
    if ours is None or ours["num_failed"]:
        errors.append(f"kvserve: {ours['num_failed'] if ours else 'no'} failed requests {ours and ours['errors']}")
    figures = {
        "workload": WORKLOAD,
        "requests": scale.bench_requests,
        "concurrency": scale.bench_concurrency,
        "max_tokens_cap": scale.bench_max_tokens,
        "hf_batch_size": scale.hf_batch_size,
        "kvserve_output_tokens_per_s": ours and ours["output_throughput"],
        "hf_output_tokens_per_s": theirs and theirs["output_throughput"],
        "vs_hf_throughput": ratio,
        "goal": goal,
        "kvserve_ttft_mean_s": ours and ours["ttft"]["mean"],
        "report": str(ctx.out_dir / "bench_serve_mixed.json"),
        "errors": errors,
    }
    rows = [
        (
            "bench serve mixed: kvserve vs HF generate",
            f"{scale.bench_requests} requests, concurrency {scale.bench_concurrency}, "
            f"max_tokens <= {scale.bench_max_tokens}, HF batch {scale.hf_batch_size}",
            f"{figures['kvserve_output_tokens_per_s'] or 0:,.0f} vs {figures['hf_output_tokens_per_s'] or 0:,.0f} "
            "output tok/s",
            "-" if ratio is None else f"{ratio:.2f}x",
            f">= {goal:g}x: {'-' if ratio is None else 'met' if ratio >= goal else 'not met'}",
        )
    ]
    summary = (
        f"vs_hf_throughput {'-' if ratio is None else f'{ratio:.2f}x'} (goal >= {goal:g}): "
        f"kvserve {figures['kvserve_output_tokens_per_s'] or 0:,.0f}, "
        f"HF {figures['hf_output_tokens_per_s'] or 0:,.0f} tok/s"
    )
    if errors:
        summary += f"; {errors[0]}"
    return Outcome(not errors and ratio is not None, summary, figures, rows, error="\n".join(errors) or None)
