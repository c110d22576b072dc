"""The Triton paged decode kernel's memory throughput: K/V bytes read per second vs the copy bandwidth.

One layer of the big model's attention (32 query heads over 8 KV heads, head_dim 128, bf16,
16-token blocks in shuffled order), called exactly as the runner calls it (splits chosen by
the kernel). A call reads every cached K and V of every sequence once, so bytes/s =
batch x context x kv_heads x head_dim x 2 (K, V) x 2 bytes / time. The goal is 70% of the
copy bandwidth measured by device_peaks. Small cases would fit in L2 and flatter the kernel,
so the timed loop cycles through disjoint block sets of a pool larger than the cache.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from kvserve.gpu_check.device_peaks import COPY_KEY, peak
from kvserve.gpu_check.random_models import load_shapes
from kvserve.gpu_check.results import Outcome
from kvserve.gpu_check.timing import seconds_per_call

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import CheckContext

GOAL_FRACTION = 0.70
BLOCK_SIZE = 16


def _attention_shape(ctx: CheckContext) -> tuple[int, int, int]:
    c = load_shapes()[ctx.scale.big_model]["config"]
    return c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]


def measure_point(
    batch: int, context: int, heads: tuple[int, int, int], device: str, min_pool_bytes: int
) -> dict[str, Any]:
    """Seconds per call and K/V bytes per second of one (batch, context) point."""
    import torch

    from kvserve.kernels.paged_decode import paged_decode_attention

    num_heads, kv_heads, head_dim = heads
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    element = torch.finfo(dtype).bits // 8
    blocks_per_seq = -(-context // BLOCK_SIZE)
    kv_bytes = batch * context * kv_heads * head_dim * 2 * element
    block_bytes = BLOCK_SIZE * kv_heads * head_dim * 2 * element
    sets = max(1, -(-min_pool_bytes // (batch * blocks_per_seq * block_bytes)))
    num_blocks = sets * batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(batch * 100_003 + context)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
    order = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    tables = order.view(sets, batch, blocks_per_seq)
    query = torch.randn(batch, num_heads, head_dim, device=device, dtype=dtype, generator=gen)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    scale = head_dim**-0.5

    def call(i: int) -> None:
        paged_decode_attention(query, k_cache, v_cache, tables[i % sets], seq_lens, scale, context, out=out)

    iterations = max(sets, 20 if kv_bytes < 2**30 else 10)
    seconds = seconds_per_call(call, iterations if device.startswith("cuda") else 2, device)
    return {
        "batch": batch,
        "context": context,
        "kv_bytes": kv_bytes,
        "seconds": seconds,
        "kv_bytes_per_s": kv_bytes / seconds,
        "block_sets": sets,
    }


def measure_decode_attention(ctx: CheckContext) -> Outcome:
    import torch

    scale, device = ctx.scale, ctx.scale.device
    heads = _attention_shape(ctx)
    copy = peak(ctx, COPY_KEY)
    points = []
    for context in scale.attention_contexts:
        for batch in scale.attention_batches:
            point = measure_point(batch, context, heads, device, scale.attention_min_pool_bytes)
            point["fraction_of_copy"] = None if not copy else point["kv_bytes_per_s"] / copy
            points.append(point)
            print(f"[gpu_check] decode attention {json.dumps(point)}", flush=True)
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    met = [p for p in points if p["fraction_of_copy"] is not None and p["fraction_of_copy"] >= GOAL_FRACTION]
    rows = [
        (
            "paged decode attention (Triton), K/V read",
            f"context {p['context']:,}, batch {p['batch']}",
            f"{p['kv_bytes_per_s'] / 1e9:,.0f} GB/s ({p['seconds'] * 1e6:,.0f} us)",
            "-" if p["fraction_of_copy"] is None else f"{p['fraction_of_copy']:.0%} of copy",
            f">= {GOAL_FRACTION:.0%}: {'met' if p in met else 'not met'}",
        )
        for p in points
    ]
    figures = {
        "heads": {"num_heads": heads[0], "kv_heads": heads[1], "head_dim": heads[2]},
        "block_size": BLOCK_SIZE,
        "copy_bytes_per_s": copy,
        "goal_fraction": GOAL_FRACTION,
        "points": points,
        "points_meeting_goal": len(met),
    }
    best = max(points, key=lambda p: p["kv_bytes_per_s"])
    best_fraction = "-" if best["fraction_of_copy"] is None else f"{best['fraction_of_copy']:.0%}"
    summary = (
        f"{len(met)}/{len(points)} points at >= {GOAL_FRACTION:.0%} of copy bandwidth; best "
        f"{best['kv_bytes_per_s'] / 1e9:,.0f} GB/s ({best_fraction}) at context {best['context']}, "
        f"batch {best['batch']}"
    )
    return Outcome(copy is not None, summary, figures, rows, error=None if copy else "no copy bandwidth measured")
