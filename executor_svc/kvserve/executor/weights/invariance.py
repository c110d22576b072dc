"""What keeps a token's logits independent of its batch, chunking, cache hits and restarts: the GEMM part.

Three parts of the forward pass could make them depend on it, and each is fixed where it lives:
attention and the SwiGLU activation run in kvserve's CPU kernels (`kvserve.kernels.cpu_ops`), and the
GEMMs get fixed call shapes (`kvserve.executor.weights.row_invariance`). This module applies the last
to a loaded model, and answers before loading whether a dtype's GEMMs can be made invariant here
at a price worth paying (`auto` picks bfloat16 only then).

The probe runs on random layers of each matrix's kernel and shape, in a child process
(`python -m kvserve.executor.weights.invariance`): what it leaves behind, oneDNN's kernels for ~45
call sizes per matrix among them, would otherwise stay resident in the executor (measured: 20 MB
past the memory bound on the default model).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass

import structlog
import torch

from kvserve.child_python import python_module
from kvserve.executor.disk_cache import cache_dir
from kvserve.executor.model_config import ModelConfig
from kvserve.executor.weights.gguf_q4_1 import random_q4_1
from kvserve.executor.weights.linear import MATMUL, PACKED, WIDENED, Linear, linear_kind, make_linear
from kvserve.executor.weights.loader import LINEAR_NAMES, ModelWeights
from kvserve.executor.weights.q4_1_linear import KIND as Q4_1
from kvserve.executor.weights.q4_1_linear import make_q4_1_linear
from kvserve.executor.weights.q8_0 import KIND as Q8
from kvserve.executor.weights.q8_0 import quantize
from kvserve.executor.weights.row_invariance import (
    AFFORDABLE_MIN_ROWS,
    MAX_ROWS,
    ProbeCache,
    RowFixedLinear,
    RowKernel,
    matmul_gflops,
    matmul_key,
    probe,
    probe_key,
)
from kvserve.kernels.cpu_ops import cpu_identity

log = structlog.get_logger(__name__)

FIXED_ORDER_KINDS = (Q4_1, Q8)
"""kvserve's own kernels, which sum each output in one order at any call size (`interleaved_linear.h`):
their calls are never split (their probe still checks the sizes up to MAX_ROWS)."""


def probe_cache() -> ProbeCache:
    """This machine's probe results for the current thread count (set the threads first)."""
    return ProbeCache(cache_dir() / "kernels", cpu_identity(), torch.get_num_threads())


@dataclass(frozen=True, slots=True)
class GemmShape:
    """One matrix as the probe sees it: the kernel, the dtype it is called with, its shape, the most rows."""

    kind: str
    dtype: str
    n_in: int
    n_out: int
    bias: bool
    max_rows: int

    @property
    def key(self) -> str:
        kind = f"{self.kind}+bias" if self.bias else self.kind
        return probe_key(kind, self.n_in, self.n_out, getattr(torch, self.dtype), self.max_rows)


def linear_shapes(config: ModelConfig, vocab_rows: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each layer matrix by `LINEAR_NAMES`, and of the lm_head (`config`: this rank's shard)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {"qkv": (h, q + 2 * kv), "o_proj": (q, h), "gate_up": (h, 2 * i), "down": (i, h), "lm_head": (h, vocab_rows)}


def lm_head_rows(max_num_seqs: int) -> int:
    """The most rows the lm_head is called with: one per sampling sequence, in calls of at most MAX_ROWS."""
    return min(max_num_seqs, MAX_ROWS)


def model_gemms(
    config: ModelConfig, vocab_rows: int, kinds: dict[str, tuple[str, torch.dtype]], max_num_seqs: int
) -> dict[str, GemmShape]:
    """Each matrix's `GemmShape`, from its (kernel, call dtype) in `kinds` (by `LINEAR_NAMES` and lm_head)."""
    shapes = {}
    for name, (n_in, n_out) in linear_shapes(config, vocab_rows).items():
        kind, dtype = kinds[name]
        rows = lm_head_rows(max_num_seqs) if name == "lm_head" else MAX_ROWS
        bias = name == "qkv" and config.attention_bias and kind != Q4_1
        shapes[name] = GemmShape(kind, str(dtype).removeprefix("torch."), n_in, n_out, bias, rows)
    return shapes


def min_rows(shapes: list[GemmShape], cache: ProbeCache, rates: tuple[torch.dtype, ...] = ()) -> dict[str, int]:
    """Each shape's `min_rows` by key, and each of `rates`' `matmul_gflops` by `matmul_key`: from the
    cache, or measured in a child process (once per machine)."""
    missing = list({s.key: s for s in shapes if cache.get(s.key) is None}.values())
    missing_rates = [str(d).removeprefix("torch.") for d in rates if cache.get(matmul_key(d)) is None]
    if missing or missing_rates:
        log.info("probing GEMM call sizes for batch invariance (once per machine, then cached)", kernels=len(missing))
        request = json.dumps({"threads": cache.threads, "shapes": [asdict(s) for s in missing], "rates": missing_rates})
        child = subprocess.run(
            python_module("kvserve.executor.weights.invariance"),
            input=request,
            capture_output=True,
            text=True,
            check=False,
        )
        if child.returncode != 0:
            raise RuntimeError(f"the GEMM probe failed (exit {child.returncode}): {child.stderr.strip()[-2000:]}")
        cache.store(json.loads(child.stdout))
    found = {}
    for key in [shape.key for shape in shapes] + [matmul_key(d) for d in rates]:
        value = cache.get(key)
        if value is None:
            raise RuntimeError(f"the GEMM probe returned no result for {key}")
        found[key] = value
    return found


@dataclass(frozen=True, slots=True)
class Padding:
    """The GEMM padding a dtype needs on this machine: the largest `min_rows` over the model's shapes,
    and what it costs in float32 rows (`AFFORDABLE_MIN_ROWS`)."""

    min_rows: int
    shape: str
    """The matrix needing it."""
    float32_rows: float
    """`min_rows` × float32's matmul rate / this dtype's: the padded call's cost in float32 rows."""

    @property
    def affordable(self) -> bool:
        return self.float32_rows <= AFFORDABLE_MIN_ROWS


def gemm_padding(
    config: ModelConfig, vocab_rows: int, dtype: torch.dtype, max_num_seqs: int, cache: ProbeCache
) -> Padding:
    """What the model's GEMMs in `dtype` would need on this CPU, before any weight is loaded."""
    kind = linear_kind("cpu", dtype)
    names = (*LINEAR_NAMES, "lm_head")
    shapes = model_gemms(config, vocab_rows, dict.fromkeys(names, (kind, dtype)), max_num_seqs)
    found = min_rows(list(shapes.values()), cache, rates=(dtype, torch.float32))
    worst = max(names, key=lambda name: found[shapes[name].key])
    padded = found[shapes[worst].key]
    rate = found[matmul_key(dtype)] / found[matmul_key(torch.float32)]
    return Padding(padded, worst, padded / rate)


def fix_model_rows(
    weights: ModelWeights,
    config: ModelConfig,
    vocab_rows: int,
    dtype: torch.dtype,
    max_num_seqs: int,
    cache: ProbeCache,
) -> None:
    """Wrap every layer matrix and the lm_head of `weights` (in place) in `RowFixedLinear`s."""
    layer = weights.layers[0]
    kinds = {name: _kind_and_dtype(getattr(layer, name), dtype) for name in LINEAR_NAMES}
    kinds["lm_head"] = _kind_and_dtype(weights.lm_head, dtype)
    shapes = model_gemms(config, vocab_rows, kinds, max_num_seqs)
    found = min_rows(list(shapes.values()), cache)

    def fixed(linear: RowKernel, name: str) -> RowFixedLinear:
        unbounded = shapes[name].kind in FIXED_ORDER_KINDS
        return RowFixedLinear(linear, found[shapes[name].key], None if unbounded else MAX_ROWS)

    for layer in weights.layers:
        for name in LINEAR_NAMES:
            setattr(layer, name, fixed(getattr(layer, name), name))
    weights.lm_head = fixed(weights.lm_head, "lm_head")


def _kind_and_dtype(linear: RowKernel, dtype: torch.dtype) -> tuple[str, torch.dtype]:
    """A matrix's kernel and the dtype it is called with: `dtype`, but float32 for the Q4_1 and Q8_0
    layers of `--weights native`."""
    kind = linear.kind.removesuffix("+bias")
    return kind, torch.float32 if kind in (Q4_1, Q8) else dtype


def random_layer(shape: GemmShape) -> RowKernel:
    """A layer of `shape`'s kernel with random weights (dispatch depends on shapes, not values)."""
    generator = torch.Generator().manual_seed(0)
    dtype = getattr(torch, shape.dtype)
    if shape.kind == Q4_1:
        return make_q4_1_linear(random_q4_1(shape.n_out, shape.n_in, generator))
    weight = (torch.randn(shape.n_out, shape.n_in, generator=generator) * 0.05).to(dtype)
    if shape.kind == Q8:
        return quantize(weight)
    bias = torch.randn(shape.n_out, generator=generator).to(dtype) if shape.bias else None
    if shape.kind == PACKED:
        layer = make_linear(weight, bias)
        assert layer.kind.removesuffix("+bias") == PACKED
        return layer
    if shape.kind == WIDENED:
        return Linear(weight=weight.contiguous(), bias=bias, widen=True)
    assert shape.kind == MATMUL, shape.kind
    return Linear(weight=weight.t().contiguous(), bias=bias)


def _probe_main() -> int:
    """The child: {"threads", "shapes": [GemmShape fields], "rates": [dtype names]} on stdin,
    {key: min_rows or GFLOP/s} on stdout."""
    request = json.load(sys.stdin)
    torch.set_num_threads(request["threads"])
    if any(fields["kind"] in (Q8, Q4_1) for fields in request["shapes"]):
        from kvserve.executor.attention.cpu_backend import ensure_kernels

        ensure_kernels()
    results = {}
    for name in request.get("rates", ()):
        dtype = getattr(torch, name)
        results[matmul_key(dtype)] = matmul_gflops(dtype)
    for fields in request["shapes"]:
        shape = GemmShape(**fields)
        results[shape.key] = probe(random_layer(shape), shape.n_in, getattr(torch, shape.dtype), shape.max_rows)
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(_probe_main())
