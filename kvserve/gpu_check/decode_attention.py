"""The Triton paged decode kernel's K/V bytes read per second, against the copy bandwidth (goal 70%).

One layer of the big model's attention, called as the runner calls it; the timed loop cycles
through disjoint block sets of a pool larger than L2, so small cases are not served from cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.gpu_check.device_peaks import COPY_KEY, seconds_per_call
from kvserve.gpu_check.random_models import load_shapes
from kvserve.gpu_check.report import Outcome

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import StageContext

GOAL_FRACTION = 0.70
WHAT = "paged decode attention (Triton), K/V read"
BLOCK_SIZE = 16


def measure_point(batch: int, context: int, heads: tuple[int, int, int], device: str, min_pool: int) -> dict[str, Any]:
    """Seconds per call and K/V bytes read per second at one (batch, context)."""
    import torch

    from kvserve.kernels.paged_decode import paged_decode_attention

    num_heads, kv_heads, head_dim = heads
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    blocks_each = -(-context // BLOCK_SIZE)
    kv_bytes = batch * context * kv_heads * head_dim * 2 * dtype.itemsize
    sets = max(1, -(-min_pool // (batch * blocks_each * BLOCK_SIZE * kv_heads * head_dim * 2 * dtype.itemsize)))
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


def measure(ctx: StageContext) -> Outcome:
    import torch

    sizes, copy = ctx.sizes, ctx.state.get(COPY_KEY)
    c = load_shapes()[sizes.big_model]["config"]
    heads = (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
    points, rows = [], []
    for context in sizes.attention_contexts:
        for batch in sizes.attention_batches:
            p = measure_point(batch, context, heads, sizes.device, sizes.attention_min_pool_bytes)
            p["fraction_of_copy"] = p["kv_bytes_per_s"] / copy if copy else None
            p["goal_met"] = bool(p["fraction_of_copy"] and p["fraction_of_copy"] >= GOAL_FRACTION)
            points.append(p)
            if sizes.device == "cuda":
                torch.cuda.empty_cache()
            fraction = "-" if copy is None else f"{p['fraction_of_copy']:.0%} of copy"
            speed = f"{p['kv_bytes_per_s'] / 1e9:,.0f} GB/s ({p['seconds'] * 1e6:,.0f} us)"
            goal = f">= {GOAL_FRACTION:.0%}: {'met' if p['goal_met'] else 'not met'}"
            rows.append((WHAT, f"context {context:,}, batch {batch}", speed, fraction, goal))
    best = max(points, key=lambda p: p["kv_bytes_per_s"])
    met = sum(p["goal_met"] for p in points)
    summary = (
        f"{met}/{len(points)} points at >= {GOAL_FRACTION:.0%} of copy bandwidth; best "
        f"{best['kv_bytes_per_s'] / 1e9:,.1f} GB/s at context {best['context']}, batch {best['batch']}"
    )
    figures = dict(
        heads=heads, block_size=BLOCK_SIZE, copy_bytes_per_s=copy, goal_fraction=GOAL_FRACTION, points=points
    )
    return Outcome(copy is not None, summary, figures, rows, error=None if copy else "no copy bandwidth measured")
