"""softmax and log_softmax over the last dim, from kvserve's CPU kernels where the step runs on them.

torch's CPU softmax and log_softmax take their exp and sums from the vector code of the capability
torch picked (default, AVX2, AVX512), so the sampler's top_p and min_p probabilities and the reported
logprobs could differ in their last bits from one CPU to another (issue 49). The kernels
(`kernels/cpu/softmax.cpp`) compute each row in one fixed order: the same bits on any x86 CPU, in any
batch, at any thread count. They are used for float32 logits on the CPU when this process has loaded
them (the executor does when it chose the CPU kernels; never compiled here, mid-step); anything else
(CUDA, another dtype, a CPU executor without the kernels) keeps torch's ops.
"""

from __future__ import annotations

import torch

from kvserve.kernels import cpu_ops


def _kernel_rows(x: torch.Tensor) -> torch.Tensor | None:
    """`x` as the kernels' contiguous float32 [rows, n], or None where torch's op must run."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() == 0 or x.shape[-1] == 0:
        return None
    if not cpu_ops.is_loaded():
        return None
    return x.reshape(-1, x.shape[-1]).contiguous()


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of `x`: the CPU kernel's fixed order where it applies, else torch's."""
    rows = _kernel_rows(x)
    return x.softmax(-1) if rows is None else cpu_ops.softmax(rows).view(x.shape)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim of `x`: the CPU kernel's fixed order where it applies, else torch's."""
    rows = _kernel_rows(x)
    return x.log_softmax(-1) if rows is None else cpu_ops.log_softmax(rows).view(x.shape)
