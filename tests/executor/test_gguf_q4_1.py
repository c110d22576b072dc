"""Q4_1 as shipped → the CPU int4 kernel's layout: the repack reproduces gguf's own dequantization,
and the kernel computes with those weights, to the stated rounding bounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants

from kvserve.executor.weights import model_store
from kvserve.executor.weights.gguf_q4_1 import (
    BLOCK_BYTES,
    GROUP,
    concat_rows,
    dequantize,
    kernel_dequantize,
    kernel_scales,
    kernel_weight,
    parse_q4_1,
)

BF16_REL = 2.0**-8
"""bfloat16 keeps 8 significand bits: rounding to it moves a value by at most 2^-8 of itself."""
F32_REL = 2.0**-23


def _random_q4_1(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid Q4_1 bytes: fp16 d and m, then random codes."""
    rng = np.random.default_rng(seed)
    groups = cols // GROUP
    blocks = rng.integers(0, 256, size=(rows, groups, BLOCK_BYTES), dtype=np.uint8)
    blocks[:, :, 0:2] = (rng.normal(size=(rows, groups, 1)) * 0.02).astype(np.float16).view(np.uint8)
    blocks[:, :, 2:4] = (rng.normal(size=(rows, groups, 1)) * 0.1).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, groups * BLOCK_BYTES)


def _bounds_hold(weight, reference: torch.Tensor) -> None:
    scales = kernel_scales(weight, torch.float32).transpose(0, 1)
    d = scales[..., 0].repeat_interleave(GROUP, dim=1).abs()
    zero = scales[..., 1].repeat_interleave(GROUP, dim=1).abs()
    exact = kernel_dequantize(weight, torch.float32)
    assert ((exact - reference).abs() <= F32_REL * (zero + reference.abs())).all()
    bf16 = kernel_dequantize(weight, torch.bfloat16)
    bound = BF16_REL * (8 * d + zero) + 2 * F32_REL * (zero + reference.abs())
    assert ((bf16 - reference).abs() <= bound).all()


def test_parsed_codes_dequantize_exactly_as_gguf_does() -> None:
    raw = _random_q4_1(48, 160)
    weight = parse_q4_1(raw)
    assert weight.shape == (48, 160) and int(weight.codes.max()) <= 15
    reference = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_1))
    assert torch.equal(dequantize(weight), reference)
    _bounds_hold(weight, reference)


def test_row_concatenation_is_exact() -> None:
    a, b = parse_q4_1(_random_q4_1(8, 64, 1)), parse_q4_1(_random_q4_1(5, 64, 2))
    assert torch.equal(dequantize(concat_rows([a, b])), torch.cat([dequantize(a), dequantize(b)]))


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_the_int4_kernel_matches_the_fp32_gemm_on_the_same_weights(rows: int) -> None:
    """bf16 activations and scales (the fast path): within 1% of the largest output of each row,
    against an fp32 GEMM over the very weights the kernel uses and the same bf16-rounded input."""
    weight = parse_q4_1(_random_q4_1(192, 256, 3))
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, kernel_weight(weight), GROUP, kernel_scales(weight, torch.bfloat16)
    ).float()
    expected = x.float() @ kernel_dequantize(weight, torch.bfloat16).t()
    tolerance = 0.01 * expected.abs().amax(dim=1, keepdim=True)
    assert ((out - expected).abs() <= tolerance).all()


@pytest.mark.slow
def test_every_q4_1_tensor_of_the_default_model_repacks_to_ggufs_dequantization() -> None:
    source = model_store.default_model_source()
    reader = GGUFReader(str(source.path / source.gguf_file))
    q4_1 = [t for t in reader.tensors if t.tensor_type == GGMLQuantizationType.Q4_1]
    assert len(q4_1) == 210  # every linear layer of the 30 blocks
    for tensor in q4_1:
        raw = np.asarray(tensor.data)
        weight = parse_q4_1(raw)
        reference = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_1))
        assert torch.equal(dequantize(weight), reference), tensor.name
        _bounds_hold(weight, reference)
