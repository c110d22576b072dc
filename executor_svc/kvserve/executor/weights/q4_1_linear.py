"""A linear layer on GGUF Q4_1 weights, through kvserve's own CPU kernel (`kvserve.kernels.cpu_ops.q4_1_linear`).

The kernel reads the file's 4-bit codes (with float32 d and m, a fifth of float32's bytes in all),
rounds the activations to 8-bit codes per run of 32 inputs, and sums each group's products of codes
exactly in integers, the arithmetic llama.cpp uses for this format (`kernels/cpu/q4_1_linear.cpp`).
Each output is then one float32 chain in group order whatever the batch, so rows do not depend on
what they were batched with.

Why 8-bit activations: at one row a decode step's cost was decoding the weights, not reading them.
The float32 kernel this replaced turned every eight codes into floats and multiplied them one by
one; an 8-bit multiply-add instruction sums 32 products. Measured on a 2-core AVX2 EPYC, 30 layers
of SmolLM2's matrices (docs/benchmarks.md): half the time at one row, and faster at every row count.
The price is the activations' rounding (a step of max|x| / 127 per 32 inputs), measured by `kvserve
bench quality` within the bounds the quantized weights themselves are held to.

Why not torch's `_weight_int4pack_mm_for_cpu`: it is fast only with bfloat16 activations, rounds its
result to bfloat16, and switching it to an fp32 GEMM for large batches made greedy output depend on
the batch (3 of 6 prompts changed in a batch of 16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.executor.weights.gguf_q4_1 import GROUP, Q4_1Weight
from kvserve.kernels import cpu_ops

KIND = "q4_1"
"""`Q4_1Linear.kind`: how the GEMM probe and its cache name this kernel."""
LANES = 8
"""Output rows the kernel interleaves: one vector of its results is eight outputs."""


@dataclass(slots=True)
class Q4_1Linear:
    """hidden -> out through Q4_1 codes; satisfies `row_invariance.RowKernel`."""

    codes: torch.Tensor
    """[out / 8, in * 4] uint8: eight rows' nibbles interleaved (`pack`)."""
    scales: torch.Tensor
    """[out / 8, in / 32, 2, 8] float32: eight rows' d, then their m, per group (fp16 values widened)."""
    out_features: int
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu_ops.q4_1_linear(x.contiguous(), self.codes, self.scales, self.out_features)
        return out if self.bias is None else out + self.bias

    @property
    def kind(self) -> str:
        return KIND


def pack(weight: Q4_1Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's (codes, scales) of `weight`, rows padded with zeros to a multiple of eight.

    Codes: for each block of eight rows and each run of eight inputs, 32 bytes, byte 4·o + j holding
    row o's input j in its low nibble and input j + 4 in its high one, so one 32-byte load meets one
    broadcast of four activation codes and gives eight rows' products side by side.
    """
    rows, width = weight.shape
    padded = -rows % LANES
    codes, d, m = weight.codes, weight.d.float(), weight.m.float()
    if padded:
        codes = torch.cat([codes, codes.new_zeros(padded, width)])
        d, m = torch.cat([d, d.new_zeros(padded, d.shape[1])]), torch.cat([m, m.new_zeros(padded, m.shape[1])])
    blocks, groups = (rows + padded) // LANES, width // GROUP
    units = codes.reshape(blocks, LANES, width // 8, 2, 4).permute(0, 2, 1, 4, 3)  # [block, unit, o, j, half]
    packed = (units[..., 0] | (units[..., 1] << 4)).reshape(blocks, width * 4).contiguous()
    scales = torch.stack([d.reshape(blocks, LANES, groups), m.reshape(blocks, LANES, groups)], dim=2)
    return packed, scales.permute(0, 3, 2, 1).contiguous()  # [block, group, d|m, o]


def make_q4_1_linear(weight: Q4_1Weight, bias: torch.Tensor | None = None) -> Q4_1Linear:
    codes, scales = pack(weight)
    return Q4_1Linear(codes, scales, weight.shape[0], bias)
