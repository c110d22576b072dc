"""A linear layer holding one copy of its weight, in the layout its device multiplies fastest.

- **CPU, float32, and bfloat16 where the CPU has bfloat16 dot products** (AVX512_BF16 or AMX):
  only a oneDNN-prepacked weight. Measured against `x @ w` on [in, out] at 1–512 rows (576 ×
  1536 and the 576 × 49152 lm_head, 2 threads): as fast at one row and 1.2–4.5× faster from 8
  rows on in fp32, 1.1–2.5× faster in bfloat16 (the lm_head at one row: 2.8 vs 7.0 ms), so no
  plain copy is kept beside it.
- **CPU, bfloat16 without bfloat16 dot products** (no AVX512_BF16 or AMX): torch's bfloat16
  GEMM is an emulation measured 3–75× slower than fp32 (1.1 s vs 15 ms for 512 × 576 × 1536).
  The bfloat16 weight is widened to fp32 for each call and the product rounded back: the
  arithmetic of a bfloat16 GEMM (exact products, fp32 accumulation, one rounding of the
  result), one bfloat16 copy in memory, at fp32 GEMM speed.
- **Elsewhere:** the weight transposed, [in, out] contiguous, so the call is `x @ w`: on CPU
  about 15% faster than `F.linear` on HF's [out, in] layout for decode-sized batches.

Which bits a row gets can still depend on how many rows share the call: `kvserve.executor.weights.row_invariance`
fixes the call shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.executor.cpu_features import has_native_bf16


@dataclass(slots=True)
class Linear:
    weight: torch.Tensor | None
    """[in, out] contiguous (`x @ weight`), or for `widen` HF's [out, in]; None when `packed` holds it."""
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    """oneDNN-prepacked weight (CPU float32, or bfloat16 with native bf16), used for every row count."""
    widen: bool = False
    """CPU bfloat16 without native bf16 dot products: compute in fp32 (see the module docstring)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None
        if self.widen:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        if self.bias is None:
            return x @ self.weight
        return torch.addmm(self.bias, x, self.weight)

    @property
    def kind(self) -> str:
        """Which kernel runs it (GEMM libraries choose their micro-kernels per kernel and shape)."""
        kind = PACKED if self.packed is not None else WIDENED if self.widen else MATMUL
        return kind if self.bias is None else f"{kind}+bias"


PACKED, WIDENED, MATMUL = "onednn-packed", "widened", "matmul"


def linear_kind(device_type: str, dtype: torch.dtype) -> str:
    """The kernel `make_linear` picks for a weight on `device_type` in `dtype`."""
    if device_type == "cpu":
        native = dtype == torch.float32 or (dtype == torch.bfloat16 and has_native_bf16())
        if native and torch.backends.mkldnn.is_available():
            return PACKED
        if dtype == torch.bfloat16:
            return WIDENED
    return MATMUL


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """`weight` in HF's [out, in] layout, already on its device and dtype."""
    kind = linear_kind(weight.device.type, weight.dtype)
    if kind == PACKED:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)
        return Linear(weight=None, bias=bias, packed=packed)
    if kind == WIDENED:
        return Linear(weight=weight.contiguous(), bias=bias, widen=True)
    return Linear(weight=weight.t().contiguous(), bias=bias)
