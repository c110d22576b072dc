"""Each dense linear path against a float64 GEMM on the same weights, at 1, 7, 64 and 300 rows.

The int4 path has its own test (test_gguf_q4_1.py). Tolerances are relative to the largest
output of each row, so they are stated in units of the result's own scale.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.executor.weights.linear import Linear, make_linear

ROWS = [1, 7, 64, 300]


def _case(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    weight = (torch.randn(192, 256, generator=g) * 0.05).to(dtype)
    bias = torch.randn(192, generator=g).to(dtype)
    x = torch.randn(rows, 256, generator=g).to(dtype)
    return x, weight, bias


def _assert_close(out: torch.Tensor, expected: torch.Tensor, relative: float) -> None:
    tolerance = relative * expected.abs().amax(dim=1, keepdim=True)
    error = (out.double() - expected).abs()
    assert (error <= tolerance).all(), f"worst error {float((error / tolerance).max()):.2f}x the tolerance"


@pytest.mark.parametrize("rows", ROWS)
def test_the_prepacked_fp32_path_matches_a_float64_gemm(rows: int) -> None:
    """fp32 accumulation over 256 products: within 1e-5 of the row's largest output."""
    x, weight, bias = _case(rows, torch.float32)
    linear = make_linear(weight, bias)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN is not built into this torch")
    assert linear.packed is not None and linear.weight is None  # one copy of the weight
    expected = x.double() @ weight.double().t() + bias.double()
    _assert_close(linear(x), expected, 1e-5)


@pytest.mark.parametrize("rows", ROWS)
def test_the_bf16_path_matches_a_float64_gemm_within_one_bf16_rounding(rows: int) -> None:
    """bf16 inputs and weights multiply exactly; the one rounding of the result to bf16 (2^-8
    relative) bounds the error, plus fp32 accumulation and the bias add."""
    x, weight, bias = _case(rows, torch.bfloat16)
    linear = make_linear(weight, bias)
    out = linear(x)
    assert out.dtype == torch.bfloat16
    expected = x.double() @ weight.double().t() + bias.double()
    _assert_close(out, expected, 2**-8 + 1e-5)


@pytest.mark.parametrize("rows", ROWS)
def test_the_widened_bf16_path_agrees_with_torchs_bf16_gemm(rows: int) -> None:
    """Widening is the arithmetic of a bf16 GEMM: both sides are one bf16 rounding from the exact result."""
    x, weight, bias = _case(rows, torch.bfloat16)
    widened = Linear(weight=weight.contiguous(), bias=bias, widen=True)
    native = torch.addmm(bias, x, weight.t())
    _assert_close(widened(x), native.double(), 2 * 2**-8)
