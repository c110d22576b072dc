"""RMSNorm as one opaque op, for decode graphs that `torch.compile` captures.

Traced as plain torch ops, RMSNorm is fused by inductor into generated C++ whose sum follows
the tensor's shape: two batch-size buckets then give one token different bits, which batch
invariance forbids (measured in docs/benchmarks.md). Behind a custom op the compiled graph calls
the eager composite instead, the same ATen kernels in the same order as
`kvserve.executor.model.llama.rms_norm` at every shape, so compiled and eager agree bit for bit.
Eager forwards keep the plain function: the op's Python dispatch would cost ~10 µs a call.
"""

from __future__ import annotations

import torch

from kvserve.executor.model.llama import rms_norm


@torch.library.custom_op("kvserve::rms_norm", mutates_args=())
def opaque_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm(x, weight, eps)`, one node in a traced graph."""
    return rms_norm(x, weight, eps)


@opaque_rms_norm.register_fake
def _shape(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)
