"""Q8_0 weights (GGUF's 8-bit format) and the linear layer that multiplies them on the CPU.

Q8_0 stores each run of 32 weights along a row as an fp16 scale `d` and 32 int8 codes: w = d·q,
with d = amax / 127 and q = round(w / d), llama.cpp's rule. The layer runs kvserve's own kernel
(`kvserve.kernels.cpu_ops.q8_linear`), which rounds the activations to Q8 blocks too and sums each
group's products exactly in integers (llama.cpp's Q8_0 × Q8_0 arithmetic): float32 logits, each
one float chain in group order, so its rows do not depend on the batch.

Why for the lm_head: at batch 1 a decode step reads every weight once, and the lm_head is the
largest matrix of a small model. SmolLM2's 49152 × 576 head is 113 MB in float32 and 30 MB in Q8_0
(`--weights native`: measured 5.2 ms of a 14 ms step in float32, docs/benchmarks.md). The default
GGUF ships its tied embedding in Q8_0 already, and `quantize` of its dequantized values gives the
file's own codes back, every one of them (`tests/executor/test_native_weights.py`): the head computes with
the weights llama.cpp computes with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kernels import cpu_ops

GROUP = 32
CODE_MAX = 127
KIND = "q8_0"
"""`Q8Linear.kind`: how the GEMM probe and its cache name this kernel."""


LANES = 8
"""Output rows the kernel interleaves: one vector of its results is eight outputs."""


@dataclass(slots=True)
class Q8Linear:
    """hidden -> out through Q8_0 codes; satisfies `row_invariance.RowKernel`."""

    codes: torch.Tensor
    """[out / 8, in * 8] int8, eight rows interleaved: per run of four inputs, 32 bytes, byte 4·o + j
    row o's input j (rows padded with zeros to a multiple of eight)."""
    d: torch.Tensor
    """[out / 8, in / 32, 8] float32 holding fp16 values (Q8_0's scales, widened once: the kernel
    reads them with no conversion per group), eight rows' side by side."""
    out_features: int

    @property
    def kind(self) -> str:
        return KIND

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.q8_linear(x.contiguous(), self.codes, self.d, self.out_features)


def quantize(weight: torch.Tensor) -> Q8Linear:
    """A float [out, in] matrix (in a multiple of 32) in Q8_0, by llama.cpp's rule."""
    out_features, in_features = weight.shape
    if in_features % GROUP:
        raise ValueError(f"Q8_0 needs an input width that is a multiple of {GROUP}, got {in_features}")
    groups = weight.float().reshape(out_features, in_features // GROUP, GROUP)
    d = (groups.abs().amax(-1) / CODE_MAX).half()
    inverse = torch.where(d != 0, 1.0 / d.float(), torch.zeros((), dtype=torch.float32))
    codes = torch.round(groups * inverse[..., None]).clamp_(-CODE_MAX, CODE_MAX).to(torch.int8)
    return pack(codes.reshape(out_features, in_features), d.float())


def pack(codes: torch.Tensor, d: torch.Tensor) -> Q8Linear:
    """Row-major Q8_0 (int8 codes [out, in], float32 scales [out, in / 32]) in the kernel's layout."""
    out_features, in_features = codes.shape
    padded = -out_features % LANES
    if padded:
        codes = torch.cat([codes, codes.new_zeros(padded, in_features)])
        d = torch.cat([d, d.new_zeros(padded, d.shape[1])])
    blocks = codes.shape[0] // LANES
    units = codes.reshape(blocks, LANES, in_features // 4, 4).transpose(1, 2)  # [block, unit, row, j]
    scales = d.reshape(blocks, LANES, -1).transpose(1, 2)  # [block, group, row]
    return Q8Linear(units.reshape(blocks, in_features * LANES).contiguous(), scales.contiguous(), out_features)


def unpack(layer: Q8Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's codes [out, in] and scales [out, in / 32] row by row, as GGUF stores them."""
    blocks, groups = layer.d.shape[0], layer.d.shape[1]
    codes = layer.codes.reshape(blocks, groups * GROUP // 4, LANES, 4).transpose(1, 2)
    codes = codes.reshape(blocks * LANES, groups * GROUP)[: layer.out_features]
    return codes, layer.d.transpose(1, 2).reshape(blocks * LANES, groups)[: layer.out_features]


def dequantize(layer: Q8Linear) -> torch.Tensor:
    """[out, in] float32, d·q exactly (every product fits a float32)."""
    codes, d = unpack(layer)
    out_features, in_features = codes.shape
    groups = codes.reshape(out_features, in_features // GROUP, GROUP).float()
    return (groups * d[..., None]).reshape(out_features, in_features)
