"""A linear layer in the layout the forward pass runs fastest on each device.

Weights are kept transposed, [in, out] contiguous, so the default path is `x @ w`: on CPU
about 15% faster than `F.linear` on HF's [out, in] layout for decode-sized batches. On CPU in
float32 a oneDNN-prepacked copy is also kept: a GEMM with 2–256 rows skips re-packing the
weight on every call, measured 15–35% faster for those row counts (and slower for a single
row, so GEMV-sized calls keep `x @ w`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PACKED_MIN_ROWS = 2
PACKED_MAX_ROWS = 256


@dataclass(slots=True)
class Linear:
    weight_t: torch.Tensor
    """[in, out] contiguous."""
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    """oneDNN-prepacked weight (CPU float32 only), used for PACKED_MIN_ROWS..PACKED_MAX_ROWS rows."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and PACKED_MIN_ROWS <= x.shape[0] <= PACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """`weight` in HF's [out, in] layout, already on its device and dtype."""
    packed = None
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)
    return Linear(weight_t=weight.t().contiguous(), bias=bias, packed=packed)
