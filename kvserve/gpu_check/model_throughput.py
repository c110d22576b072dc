"""8B-shaped decode and prefill throughput of the runner, as fractions of the device's peaks.

The steps are `kvserve bench executor`'s (kvserve.bench.executor: prompts prefilled
untimed, then the median of a few decode steps; fresh prompts in one prefill step), on the
measure stage's runner. Decode is read against the copy bandwidth: (weights + K/V read and
written) bytes per step / step time (roofline.StepCost). Prefill against the bf16 matmul peak:
FLOPs per step / step time. Both peaks come from device_peaks, measured minutes earlier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.gpu_check.device_peaks import COPY_KEY, GEMM_KEY, peak
from kvserve.gpu_check.kv_sizing import big_runner
from kvserve.gpu_check.results import Outcome
from kvserve.gpu_check.roofline import StepCost

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import CheckContext


def _cost(runner: Any) -> StepCost:
    return StepCost.of(runner.model_config, runner.cache.tensor.element_size())


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def measure_decode(ctx: CheckContext) -> Outcome:
    from kvserve.bench.executor import time_decode
    from kvserve.protos.sampling import SamplingParams

    scale = ctx.scale
    runner = big_runner(ctx)
    cost, copy = _cost(runner), peak(ctx, COPY_KEY)
    prompt_len = scale.decode_prompt_len
    context = prompt_len + 2  # the first timed step's; later ones read a few more tokens (a lower bound)
    points: list[dict[str, Any]] = []
    for i, batch in enumerate(scale.decode_batches):
        greedy = SamplingParams(temperature=0.0)
        step_s, _ = time_decode(runner, batch, prompt_len, scale.decode_steps, greedy, seq_base=(i + 1) * 100_000)
        tokens_per_s = batch / step_s
        print(f"[gpu_check] decode batch {batch}: {tokens_per_s:,.0f} tok/s", flush=True)
        step_bytes = cost.decode_bytes(batch, context)
        points.append(
            {
                "batch": batch,
                "context": context,
                "tokens_per_s": tokens_per_s,
                "step_s": step_s,
                "bytes_per_step": step_bytes,
                "weight_bytes_per_step": cost.weight_bytes_per_step,
                "fraction_of_copy": None if not copy else step_bytes / step_s / copy,
            }
        )
    full = ctx.state.get("full_pool_decode")
    if full:  # kv_sizing's decode over the whole pool: the KV-heavy end of decode
        step_bytes = cost.decode_bytes(full["sequences"], full["context"] - 1)
        points.append(
            {
                "batch": full["sequences"],
                "context": full["context"],
                "tokens_per_s": full["sequences"] / full["step_s"],
                "step_s": full["step_s"],
                "bytes_per_step": step_bytes,
                "weight_bytes_per_step": cost.weight_bytes_per_step,
                "fraction_of_copy": None if not copy else step_bytes / full["step_s"] / copy,
                "whole_pool": True,
            }
        )
    rows = [
        (
            "decode, 8B-shaped, bf16" if runner.device.startswith("cuda") else "decode (rehearsal)",
            f"batch {p['batch']}, context {p['context']:,}" + (" (whole KV pool)" if p.get("whole_pool") else ""),
            f"{p['tokens_per_s']:,.0f} tok/s ({p['step_s'] * 1e3:.2f} ms/step)",
            f"{_fraction(p['fraction_of_copy'])} of copy BW",
            "-",
        )
        for p in points
    ]
    figures = {"copy_bytes_per_s": copy, "decode_steps": scale.decode_steps, "points": points}
    summary = "; ".join(
        f"B={p['batch']}: {p['tokens_per_s']:,.0f} tok/s ({_fraction(p['fraction_of_copy'])})" for p in points
    )
    return Outcome(copy is not None, summary, figures, rows, error=None if copy else "no copy bandwidth measured")


def measure_prefill(ctx: CheckContext) -> Outcome:
    from kvserve.bench.executor import bench_prefill

    runner = big_runner(ctx)
    cost, gemm = _cost(runner), peak(ctx, GEMM_KEY)
    points: list[dict[str, Any]] = []
    for i, (sequences, prompt_len) in enumerate(ctx.scale.prefill_shapes):
        tokens_per_s = bench_prefill(runner, sequences, prompt_len, repeats=2, seq_base=(60 + i) * 100_000)
        step_s = sequences * prompt_len / tokens_per_s
        print(f"[gpu_check] prefill {sequences} x {prompt_len}: {tokens_per_s:,.0f} tok/s", flush=True)
        flops = cost.prefill_flops(sequences, prompt_len)
        points.append(
            {
                "sequences": sequences,
                "prompt_len": prompt_len,
                "tokens_per_s": tokens_per_s,
                "step_s": step_s,
                "flops_per_step": flops,
                "fraction_of_matmul_peak": None if not gemm else flops / step_s / gemm,
            }
        )
    rows = [
        (
            "prefill, 8B-shaped, bf16" if runner.device.startswith("cuda") else "prefill (rehearsal)",
            f"{p['sequences']} x {p['prompt_len']:,} tokens",
            f"{p['tokens_per_s']:,.0f} tok/s",
            f"{_fraction(p['fraction_of_matmul_peak'])} of bf16 matmul peak",
            "-",
        )
        for p in points
    ]
    figures = {"bf16_matmul_flops": gemm, "points": points}
    summary = "; ".join(
        f"{p['sequences']}x{p['prompt_len']}: {p['tokens_per_s']:,.0f} tok/s "
        f"({_fraction(p['fraction_of_matmul_peak'])})"
        for p in points
    )
    return Outcome(gemm is not None, summary, figures, rows, error=None if gemm else "no matmul peak measured")
