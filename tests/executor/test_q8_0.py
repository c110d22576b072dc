"""Q8_0 quantization (`kvserve.executor.weights.q8_0`) by llama.cpp's rule, and its layer."""

from __future__ import annotations

import pytest
import torch

from kvserve.executor.attention.cpu_backend import ensure_kernels
from kvserve.executor.weights.q8_0 import CODE_MAX, GROUP, dequantize, quantize, unpack
from kvserve.kernels.reference import q8_activations_reference


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    ensure_kernels()


def test_quantize_follows_the_q8_0_rule_and_dequantizes_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 3 * GROUP, generator=gen)
    weight[3, :GROUP] = 0.0  # an all-zero group: scale 0, codes 0
    layer = quantize(weight)
    codes, d = unpack(layer)
    assert codes.dtype == torch.int8 and codes.shape == weight.shape
    assert d.shape == (24, 3) and d.dtype == torch.float32
    assert torch.equal(d, d.half().float())  # fp16 values, as GGUF stores them
    groups = weight.reshape(24, 3, GROUP)
    assert torch.equal(d, (groups.abs().amax(-1) / CODE_MAX).half().float())
    assert codes.abs().max() <= CODE_MAX
    step = d.repeat_interleave(GROUP, dim=1)
    assert ((dequantize(layer) - weight).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(codes[3, :GROUP], torch.zeros(GROUP, dtype=torch.int8))


def test_quantizing_dequantized_q8_0_gives_the_same_codes_back() -> None:
    """How the lm_head gets a GGUF's own codes from the converted fp32 directory."""
    gen = torch.Generator().manual_seed(1)
    first = quantize(torch.randn(64, 4 * GROUP, generator=gen) * 0.05)
    again = quantize(dequantize(first))
    assert torch.equal(again.codes, first.codes) and torch.equal(again.d, first.d)


def test_the_layer_multiplies_its_dequantized_weights_by_8_bit_activations() -> None:
    """100 outputs: the last block of eight padded. The float64 product of the activations rounded to
    Q8 blocks and the dequantized weights, to float32 summation error."""
    gen = torch.Generator().manual_seed(2)
    layer = quantize(torch.randn(100, 2 * GROUP, generator=gen))
    x = torch.randn(5, 2 * GROUP, generator=gen)
    qx, dx = q8_activations_reference(x)
    x_q8 = (qx.double() * dx.double()[..., None]).reshape(x.shape)
    torch.testing.assert_close(layer(x), (x_q8 @ dequantize(layer).double().t()).float(), rtol=1e-5, atol=1e-5)
    assert layer.kind == "q8_0"


def test_a_width_that_is_not_whole_groups_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40))
