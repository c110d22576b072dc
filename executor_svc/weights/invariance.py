"""What keeps a token's logits independent of its batch, chunking, cache hits and restarts.

Three parts of the forward pass could make them depend on it, and each is fixed where it lives:
attention and the SwiGLU activation run in kvserve's CPU kernels (`kernels.cpu_ops`), and the
GEMMs get fixed call shapes (`executor_svc.weights.row_invariance`). This module applies the last to a
loaded model and answers, before loading, whether a dtype's GEMMs can be made invariant here at a
price worth paying (`auto` picks bfloat16 only then).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.disk_cache import cache_dir
from executor_svc.model_config import ModelConfig
from executor_svc.weights.linear import linear_kind, make_linear
from executor_svc.weights.loader import LINEAR_NAMES, ModelWeights
from executor_svc.weights.row_invariance import (
    AFFORDABLE_MIN_ROWS,
    MAX_ROWS,
    ProbeCache,
    RowFixedLinear,
    fix_rows,
    probe,
    probe_key,
)
from kernels.cpu_ops import cpu_identity


def probe_cache() -> ProbeCache:
    return ProbeCache(cache_dir() / "kernels", cpu_identity())


def linear_shapes(config: ModelConfig, vocab_rows: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each layer matrix by `LINEAR_NAMES`, and of the lm_head (`config`: this rank's shard)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {"qkv": (h, q + 2 * kv), "o_proj": (q, h), "gate_up": (h, 2 * i), "down": (i, h), "lm_head": (h, vocab_rows)}


def lm_head_rows(max_num_seqs: int) -> int:
    """The most rows the lm_head is called with: one per sampling sequence, in calls of at most MAX_ROWS."""
    return min(max_num_seqs, MAX_ROWS)


@dataclass(frozen=True, slots=True)
class Padding:
    """The GEMM padding a dtype needs on this machine: the largest `min_rows` over the model's shapes."""

    min_rows: int
    shape: str
    """The matrix needing it."""

    @property
    def affordable(self) -> bool:
        return self.min_rows <= AFFORDABLE_MIN_ROWS


def gemm_padding(
    config: ModelConfig, vocab_rows: int, dtype: torch.dtype, max_num_seqs: int, cache: ProbeCache
) -> Padding:
    """Probe (or read from the cache) the model's GEMM shapes in `dtype` on the CPU, on random weights."""
    worst = Padding(1, "")
    for name, (n_in, n_out) in linear_shapes(config, vocab_rows).items():
        rows = lm_head_rows(max_num_seqs) if name == "lm_head" else MAX_ROWS
        bias = name == "qkv" and config.attention_bias
        kind = linear_kind("cpu", dtype) + ("+bias" if bias else "")

        def measure(n_in: int = n_in, n_out: int = n_out, rows: int = rows, bias: bool = bias) -> int:
            generator = torch.Generator().manual_seed(0)
            weight = (torch.randn(n_out, n_in, generator=generator) * 0.05).to(dtype)
            linear = make_linear(weight, torch.randn(n_out, generator=generator).to(dtype) if bias else None)
            return probe(linear, n_in, dtype, rows)

        min_rows = cache.min_rows(probe_key(kind, n_in, n_out, dtype, rows), measure)
        if min_rows > worst.min_rows:
            worst = Padding(min_rows, name)
    return worst


def fix_model_rows(
    weights: ModelWeights,
    config: ModelConfig,
    vocab_rows: int,
    dtype: torch.dtype,
    max_num_seqs: int,
    cache: ProbeCache,
) -> None:
    """Wrap every layer matrix and the lm_head of `weights` (in place) in `RowFixedLinear`s."""
    shapes = linear_shapes(config, vocab_rows)
    for layer in weights.layers:
        for name in LINEAR_NAMES:
            linear = getattr(layer, name)
            if not isinstance(linear, RowFixedLinear):
                setattr(layer, name, fix_rows(linear, *shapes[name], _activation(linear, dtype), cache))
    if not isinstance(weights.lm_head, RowFixedLinear):
        n_in, n_out = shapes["lm_head"]
        weights.lm_head = fix_rows(weights.lm_head, n_in, n_out, dtype, cache, lm_head_rows(max_num_seqs))


def _activation(linear: object, dtype: torch.dtype) -> torch.dtype:
    """What a layer matrix is called with: `dtype`, except int4 layers, which take float32 (`--weights native`)."""
    return torch.float32 if getattr(linear, "kind", "") == "int4pack" else dtype
