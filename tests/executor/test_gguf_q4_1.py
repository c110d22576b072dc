"""Q4_1 as shipped → kvserve's Q4_1 kernel: the parse reproduces gguf's own dequantization, the
kernel's layout holds the file's own nibbles and scales, and the kernel computes with exactly those
weights (against activations rounded to Q8 blocks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants

from kvserve.executor.attention.cpu_backend import ensure_kernels
from kvserve.executor.weights import model_store
from kvserve.executor.weights.gguf_q4_1 import (
    BLOCK_BYTES,
    GROUP,
    concat_rows,
    dequantize,
    parse_q4_1,
)
from kvserve.executor.weights.q4_1_linear import make_q4_1_linear, pack
from kvserve.kernels.reference import q4_1_linear_reference, q8_activations_reference, unpack_q4_1


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    """The Q4_1 layers call kvserve's CPU kernels, which this module must not rely on another to have loaded."""
    ensure_kernels()


def _random_q4_1(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid Q4_1 bytes: fp16 d and m, then random codes."""
    rng = np.random.default_rng(seed)
    groups = cols // GROUP
    blocks = rng.integers(0, 256, size=(rows, groups, BLOCK_BYTES), dtype=np.uint8)
    blocks[:, :, 0:2] = (rng.normal(size=(rows, groups, 1)) * 0.02).astype(np.float16).view(np.uint8)
    blocks[:, :, 2:4] = (rng.normal(size=(rows, groups, 1)) * 0.1).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, groups * BLOCK_BYTES)


def _packs_back_to_the_file(weight, raw: np.ndarray) -> None:
    """The kernel's layout holds the file's own nibbles and fp16 d, m: nothing re-derived."""
    blocks = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, BLOCK_BYTES)
    packed = torch.from_numpy(blocks[:, :, 4:].copy())
    file_codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(raw.shape[0], -1)  # GGUF: j, j + 16
    q, d, m = unpack_q4_1(*pack(weight), raw.shape[0])
    assert torch.equal(q, file_codes)
    assert torch.equal(d, torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[..., 0]).float())
    assert torch.equal(m, torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0]).float())


def test_parsed_codes_dequantize_exactly_as_gguf_does() -> None:
    raw = _random_q4_1(48, 160)
    weight = parse_q4_1(raw)
    assert weight.shape == (48, 160) and int(weight.codes.max()) <= 15
    reference = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_1))
    assert torch.equal(dequantize(weight), reference)
    _packs_back_to_the_file(weight, raw)


def test_row_concatenation_is_exact() -> None:
    a, b = parse_q4_1(_random_q4_1(8, 64, 1)), parse_q4_1(_random_q4_1(5, 64, 2))
    assert torch.equal(dequantize(concat_rows([a, b])), torch.cat([dequantize(a), dequantize(b)]))


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_the_layer_computes_with_the_dequantized_weights(rows: int) -> None:
    """float32 activations rounded to Q8 blocks, float32 out: the float64 product of those activations
    with gguf's own dequantized weights, to float32 summation error; a single-row call of any of its
    rows gives that row's bits. 52 rows: the last block of eight is padded."""
    raw = _random_q4_1(52, 256, 3)
    layer = make_q4_1_linear(parse_q4_1(raw))
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 52)
    reference = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_1)).double()
    qx, dx = q8_activations_reference(x)
    expected = ((qx.double() * dx.double()[..., None]).reshape(rows, 256) @ reference.t()).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, q4_1_linear_reference(x, layer.codes, layer.scales, 52), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer(x[-1:].clone()), out[-1:])


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
        _packs_back_to_the_file(weight, raw)
