"""8B-shaped decode and prefill throughput (`bench executor`'s steps) as fractions of the peaks.

Decode is memory-bound: weights once + every cached K/V (kvserve.protos.kv_geometry) per step,
against the copy bandwidth. Prefill is compute-bound: its FLOPs against the bf16 matmul peak.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.gpu_check.device_peaks import COPY_KEY, GEMM_KEY
from kvserve.gpu_check.kv_sizing import big_runner
from kvserve.gpu_check.report import Outcome

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import StageContext


def decode_bytes(runner: Any, batch: int, context: int) -> int:
    """HBM traffic of one decode step of `batch` sequences at `context` cached tokens each."""
    from kvserve.protos.kv_geometry import KvGeometry, bytes_per_token

    c, element = runner.model_config, runner.cache.tensor.element_size()
    kv_token = bytes_per_token(KvGeometry(c.num_layers, c.num_kv_heads, c.head_dim), runner.dtype_name)
    embedding = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size  # a lookup: only `batch` rows read
    return (c.num_params - embedding + batch * c.hidden_size) * element + batch * (context + 1) * kv_token


def prefill_flops(runner: Any, sequences: int, prompt_len: int) -> float:
    """FLOPs of one step prefilling `sequences` fresh prompts of `prompt_len` tokens."""
    c = runner.model_config
    table = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)  # embedding + lm_head
    layers = 2.0 * (c.num_params - table) * sequences * prompt_len
    attention = 4.0 * c.num_layers * c.num_heads * c.head_dim * sequences * prompt_len * (prompt_len + 1) / 2
    return layers + 2.0 * c.vocab_size * c.hidden_size * sequences + attention


def _fraction(value: float | None, of: str) -> str:
    return "-" if value is None else f"{value:.0%} of {of}"


def measure_decode(ctx: StageContext) -> Outcome:
    from kvserve.bench.executor import time_decode
    from kvserve.protos.sampling import SamplingParams

    sizes, runner, copy = ctx.sizes, big_runner(ctx), ctx.state.get(COPY_KEY)
    greedy, prompt_len = SamplingParams(temperature=0.0), sizes.decode_prompt_len
    # the first timed step's context; later steps read a few more tokens (a lower bound)
    timed = [(b, prompt_len + 2, "") for b in sizes.decode_batches]
    steps = [
        time_decode(runner, b, prompt_len, sizes.decode_steps, greedy, (i + 1) * 100_000)[0]
        for i, (b, *_) in enumerate(timed)
    ]
    if full := ctx.state.get("full_pool_decode"):  # kv_sizing's decode over the whole pool: the KV-heavy end
        timed.append((full["sequences"], full["context"] - 1, " (whole KV pool)"))
        steps.append(full["step_s"])
    points: list[dict[str, Any]] = []
    rows = []
    for (batch, context, note), step_s in zip(timed, steps):
        fraction = decode_bytes(runner, batch, context) / step_s / copy if copy else None
        points.append(dict(batch=batch, context=context, tokens_per_s=batch / step_s, step_s=step_s))
        points[-1]["fraction_of_copy"] = fraction
        speed = f"{batch / step_s:,.0f} tok/s ({step_s * 1e3:.2f} ms/step)"
        setting = f"batch {batch}, context {context:,}{note}"
        rows.append((f"decode, {sizes.big_model}", setting, speed, _fraction(fraction, "copy BW"), "-"))
    summary = "; ".join(
        f"B={p['batch']}: {p['tokens_per_s']:,.0f} tok/s ({_fraction(p['fraction_of_copy'], 'copy')})" for p in points
    )
    figures = {COPY_KEY: copy, "decode_steps": sizes.decode_steps, "points": points}
    return Outcome(copy is not None, summary, figures, rows, None if copy else "no copy bandwidth measured")


def measure_prefill(ctx: StageContext) -> Outcome:
    from kvserve.bench.executor import bench_prefill

    runner, gemm = big_runner(ctx), ctx.state.get(GEMM_KEY)
    points: list[dict[str, Any]] = []
    rows = []
    for i, (seqs, prompt_len) in enumerate(ctx.sizes.prefill_shapes):
        tokens_per_s = bench_prefill(runner, seqs, prompt_len, repeats=2, seq_base=(60 + i) * 100_000)
        fraction = prefill_flops(runner, seqs, prompt_len) * tokens_per_s / (seqs * prompt_len) / gemm if gemm else None
        points.append(dict(sequences=seqs, prompt_len=prompt_len, tokens_per_s=tokens_per_s))
        points[-1]["fraction_of_matmul_peak"] = fraction
        value, shown = f"{tokens_per_s:,.0f} tok/s", _fraction(fraction, "bf16 matmul peak")
        rows.append((f"prefill, {ctx.sizes.big_model}", f"{seqs} x {prompt_len:,} tokens", value, shown, "-"))
    summary = "; ".join(f"{r[1]}: {r[2]} ({r[3]})" for r in rows)
    error = None if gemm else "no matmul peak measured"
    return Outcome(gemm is not None, summary, {GEMM_KEY: gemm, "points": points}, rows, error)
