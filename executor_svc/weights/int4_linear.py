"""A linear layer on GGUF Q4_1 weights through torch's CPU int4 GEMM, at every batch size.

`_weight_int4pack_mm_for_cpu` reads 4-bit weights, an eighth of fp32's bytes, which is what
a memory-bound decode step needs. It is fast only with bfloat16 activations (with float32
ones it takes a path measured ~20× slower on this project's CPUs), so inputs are rounded to
bfloat16 and the bfloat16 result widened back to float32 for the rest of the forward pass.

One kernel for every row count, on purpose: switching to an fp32 GEMM for large batches
(faster past ~32 rows on an AVX2 CPU) made greedy output depend on what a sequence was
batched with (3 of 6 prompts changed in a batch of 16), which `--weights native` must not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.executor.weights.gguf_q4_1 import GROUP, Q4_1Weight, kernel_scales, kernel_weight

ACTIVATION_DTYPE = torch.bfloat16


@dataclass(slots=True)
class Int4Linear:
    packed: torch.Tensor
    """Codes in torch's CPU int4 layout."""
    scales: torch.Tensor
    """[in / 32, out, 2] bfloat16 (scale, zero)."""
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(ACTIVATION_DTYPE), self.packed, GROUP, self.scales)
        out = out.float()
        return out if self.bias is None else out + self.bias

    @property
    def kind(self) -> str:
        return "int4pack"


def make_int4_linear(weight: Q4_1Weight, bias: torch.Tensor | None = None) -> Int4Linear:
    return Int4Linear(kernel_weight(weight), kernel_scales(weight, ACTIVATION_DTYPE), bias)
