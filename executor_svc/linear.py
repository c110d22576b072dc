"""A linear layer holding one copy of its weight, in the layout its device multiplies fastest.

- **CPU, float32:** only a oneDNN-prepacked weight. Measured against `x @ w` on [in, out] at
  1–512 rows (576 × 1536 and the 576 × 49152 lm_head, 2 threads): as fast at one row and
  1.2–4.5× faster from 8 rows on, so no plain copy is kept beside it.
- **CPU, bfloat16 without bfloat16 dot products** (no AVX512_BF16 or AMX): torch's bfloat16
  GEMM is an emulation measured 3–75× slower than fp32 (1.1 s vs 15 ms for 512 × 576 × 1536).
  The bfloat16 weight is widened to fp32 for each call and the product rounded back: the
  arithmetic of a bfloat16 GEMM (exact products, fp32 accumulation, one rounding of the
  result), one bfloat16 copy in memory, at fp32 GEMM speed.
- **Elsewhere:** the weight transposed, [in, out] contiguous, so the call is `x @ w`: on CPU
  about 15% faster than `F.linear` on HF's [out, in] layout for decode-sized batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.cpu_features import has_native_bf16


@dataclass(slots=True)
class Linear:
    weight_t: torch.Tensor | None
    """[in, out] contiguous; None when `packed` holds the weight."""
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    """oneDNN-prepacked weight (CPU float32), used for every row count."""
    widen: bool = False
    """CPU bfloat16 without native bf16 dot products: compute in fp32 (see the module docstring)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight_t is not None
        if self.widen:
            out = x.float() @ self.weight_t.float()
            out = out if self.bias is None else out.add_(self.bias)
            return out.to(x.dtype)
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """`weight` in HF's [out, in] layout, already on its device and dtype."""
    on_cpu = weight.device.type == "cpu"
    if on_cpu and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
        return Linear(weight_t=None, bias=bias, packed=torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64))
    widen = on_cpu and weight.dtype == torch.bfloat16 and not has_native_bf16()
    return Linear(weight_t=weight.t().contiguous(), bias=bias, widen=widen)
