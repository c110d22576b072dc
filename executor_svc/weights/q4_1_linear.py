"""A linear layer on GGUF Q4_1 weights, through kvserve's own CPU kernel (`kvserve.kernels.cpu_ops.q4_1_linear`).

The kernel reads the file's 4-bit codes (with float32 d and m, a fifth of float32's bytes in all)
and decodes each weight to the float32 value the dequantized model holds, d·q + m, so `--weights
native` computes with the dequantized path's weights in float32, only summed in another order. Each
output is one chain in a fixed order whatever the batch, so rows do not depend on what they were
batched with.

Why not torch's `_weight_int4pack_mm_for_cpu`, which this replaced: it is fast only with bfloat16
activations (a cast each way around every call), rounds its result to bfloat16, and switching it to
an fp32 GEMM for large batches made greedy output depend on the batch (3 of 6 prompts changed in a
batch of 16). Measured on a 2-core AVX2 EPYC, 30 layers of SmolLM2's matrices, 2 threads: 5.2 ms at
one row against its 9.1 ms, and 65 / 119 ms at 32 / 64 rows against its 86 / 171 (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.executor.weights.gguf_q4_1 import Q4_1Weight, kernel_scales, pack_codes
from kvserve.kernels import cpu_ops

KIND = "q4_1"
"""`Q4_1Linear.kind`: how the GEMM probe and its cache name this kernel."""


@dataclass(slots=True)
class Q4_1Linear:
    """hidden -> out through Q4_1 codes; satisfies `row_invariance.RowKernel`."""

    codes: torch.Tensor
    """[out, in / 2] uint8 in GGUF's byte order (`gguf_q4_1.pack_codes`)."""
    scales: torch.Tensor
    """[out, in / 32, 2] float32: (d, m) per group, fp16 values widened once."""
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu_ops.q4_1_linear(x.contiguous(), self.codes, self.scales)
        return out if self.bias is None else out + self.bias

    @property
    def kind(self) -> str:
        return KIND


def make_q4_1_linear(weight: Q4_1Weight, bias: torch.Tensor | None = None) -> Q4_1Linear:
    return Q4_1Linear(pack_codes(weight), kernel_scales(weight), bias)
