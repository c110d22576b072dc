"""Q8_0 quantization (`kvserve.executor.weights.q8_0`) by llama.cpp's rule, and its layer."""

from __future__ import annotations

import pytest
import torch

from kvserve.executor.attention.cpu_backend import ensure_kernels
from kvserve.executor.weights.q8_0 import CODE_MAX, GROUP, dequantize, quantize


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    ensure_kernels()


def test_quantize_follows_the_q8_0_rule_and_dequantizes_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 3 * GROUP, generator=gen)
    weight[3, :GROUP] = 0.0  # an all-zero group: scale 0, codes 0
    layer = quantize(weight)
    assert layer.codes.dtype == torch.int8 and layer.codes.shape == weight.shape
    assert layer.d.shape == (24, 3) and layer.d.dtype == torch.float32
    assert torch.equal(layer.d, layer.d.half().float())  # fp16 values, as GGUF stores them
    groups = weight.reshape(24, 3, GROUP)
    assert torch.equal(layer.d, (groups.abs().amax(-1) / CODE_MAX).half().float())
    assert layer.codes.abs().max() <= CODE_MAX
    step = layer.d.repeat_interleave(GROUP, dim=1)
    assert ((dequantize(layer) - weight).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(layer.codes[3, :GROUP], torch.zeros(GROUP, dtype=torch.int8))


def test_quantizing_dequantized_q8_0_gives_the_same_codes_back() -> None:
    """How the lm_head gets a GGUF's own codes from the converted fp32 directory."""
    gen = torch.Generator().manual_seed(1)
    first = quantize(torch.randn(64, 4 * GROUP, generator=gen) * 0.05)
    again = quantize(dequantize(first))
    assert torch.equal(again.codes, first.codes) and torch.equal(again.d, first.d)


def test_the_layer_multiplies_its_dequantized_weights() -> None:
    gen = torch.Generator().manual_seed(2)
    layer = quantize(torch.randn(100, 2 * GROUP, generator=gen))
    x = torch.randn(5, 2 * GROUP, generator=gen)
    torch.testing.assert_close(layer(x), x @ dequantize(layer).t(), rtol=1e-5, atol=1e-5)
    assert layer.kind == "q8_0"


def test_a_width_that_is_not_whole_groups_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40))
