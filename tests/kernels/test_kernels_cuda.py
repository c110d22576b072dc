"""Every Triton kernel against its torch reference on CUDA, in float16, bfloat16 and float32.

`pytest -m cuda` (scripts/gpu_check.sh runs it on the GPU machine); skipped without CUDA, where
test_kernels.py covers the same kernels through the interpreter. The shapes are test_kernels.py's
(its helper builds the same shuffled paged caches) at every block size, plus long contexts (8k
tokens) and many sequences (256) in the Llama-3.1-8B head layout (32 query heads over 8 KV heads,
head_dim 128). The references run in float32 on the same dtype-rounded inputs.

Tolerances are the dtype's: bfloat16 keeps 8 mantissa bits, and float32 dots run as TF32 on CUDA
(10 bits) unless TRITON_F32_DEFAULT=ieee; an indexing or masking bug is off by O(1), far beyond.
Stores are copies, so they must be exact in every dtype.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.config.defaults import BLOCK_SIZES
from kvserve.kernels.reference import paged_attention_reference, store_kv_reference
from tests.kernels.test_kernels import _random_paged_cache

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOLERANCES = {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 1e-2}
"""atol = rtol per dtype (outputs are O(1): softmax-weighted sums of unit-normal values)."""
dtypes = pytest.mark.parametrize("dtype", list(TOLERANCES), ids=lambda d: str(d).removeprefix("torch."))
block_sizes = pytest.mark.parametrize("block_size", BLOCK_SIZES)
LLAMA_8B_HEADS = (32, 8, 128)


def _cuda(dtype: torch.dtype, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to("cuda", dtype) for t in tensors]


def _assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def _reference(query, k_cache, v_cache, starts, seq_lens, tables, scale):
    """The torch reference, on the GPU (its position ranges are made on the default device)."""
    with torch.device("cuda"):
        return paged_attention_reference(query, k_cache, v_cache, starts, seq_lens, tables, scale)


def _decode(dtype, seq_lens, heads, block_size, seed, num_splits=None):
    from kvserve.kernels.paged_decode import paged_decode_attention

    num_heads, kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables, padded = _random_paged_cache(seq_lens, kv_heads, head_dim, gen, block_size)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    query, k_cache, v_cache = _cuda(dtype, query, k_cache, v_cache)
    scale = head_dim**-0.5
    expected = _reference(query, k_cache, v_cache, list(range(len(seq_lens) + 1)), seq_lens, tables, scale)
    got = paged_decode_attention(
        query,
        k_cache,
        v_cache,
        padded.cuda(),
        torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        scale,
        num_splits=num_splits,
    )
    _assert_close(got, expected, dtype)


def _extend(dtype, shapes, heads, block_size, seed):
    """`shapes`: (context already cached, new tokens) per sequence."""
    from kvserve.kernels.prefill_extend import extend_attention

    num_heads, kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in shapes]
    starts = [0]
    for _, q in shapes:
        starts.append(starts[-1] + q)
    k_cache, v_cache, tables, padded = _random_paged_cache(seq_lens, kv_heads, head_dim, gen, block_size)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=gen)
    query, k_cache, v_cache = _cuda(dtype, query, k_cache, v_cache)
    scale = head_dim**-0.5
    expected = _reference(query, k_cache, v_cache, starts, seq_lens, tables, scale)
    got = extend_attention(
        query,
        k_cache,
        v_cache,
        padded.cuda(),
        torch.tensor(starts, dtype=torch.int32, device="cuda"),
        torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        scale,
        max_query_len=max(q for _, q in shapes),
    )
    _assert_close(got, expected, dtype)


# --- store_kv ---------------------------------------------------------------------------


@block_sizes
@dtypes
@pytest.mark.parametrize("num_tokens", [6, 8192])
def test_store_kv_is_an_exact_scatter(block_size, dtype, num_tokens):
    from kvserve.kernels.store_kv import store_kv

    gen = torch.Generator().manual_seed(block_size + num_tokens)
    kv_heads, head_dim = (3, 64) if num_tokens == 6 else (8, 128)
    num_blocks = num_tokens // block_size + 8
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # skipped tokens (padding): their slots must stay as they were
    fused = torch.randn(num_tokens, 2 * kv_heads * head_dim + 8, generator=gen).to(dtype)  # strided, like qkv
    key = fused[:, : kv_heads * head_dim].view(-1, kv_heads, head_dim)
    value = fused[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(-1, kv_heads, head_dim)
    expected_k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    expected_v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    k_cache, v_cache = expected_k.cuda(), expected_v.cuda()
    store_kv_reference(key, value, expected_k, expected_v, slots)
    cuda_key, cuda_value = (t.cuda() for t in (key, value))  # .cuda() keeps the strided row layout
    store_kv(cuda_key, cuda_value, k_cache, v_cache, slots.cuda())
    assert torch.equal(k_cache.cpu(), expected_k) and torch.equal(v_cache.cpu(), expected_v)


# --- paged decode: test_kernels.py's shapes, then long contexts and many sequences ----


@block_sizes
@dtypes
@pytest.mark.parametrize("heads", [(4, 4, 64), (6, 2, 64), (8, 2, 128)], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_matches_reference(block_size, dtype, heads, num_splits):
    seed = heads[0] * 100 + heads[2] + num_splits + block_size
    _decode(dtype, [1, block_size, 37, 70], heads, block_size, seed, num_splits)


@block_sizes
@dtypes
def test_paged_decode_long_contexts(block_size, dtype):
    """8k-token contexts, split as the runner splits them (num_splits chosen by the kernel)."""
    _decode(dtype, [8192, 8191, 4097, 1], LLAMA_8B_HEADS, block_size, seed=8192 + block_size)


@block_sizes
@dtypes
def test_paged_decode_256_sequences(block_size, dtype):
    lengths = random.Random(block_size).choices(range(1, 1025), k=256)
    _decode(dtype, lengths, LLAMA_8B_HEADS, block_size, seed=256 + block_size)


# --- prefill / extend: test_kernels.py's mixed batch, then long contexts and many sequences


@block_sizes
@dtypes
@pytest.mark.parametrize("heads", [(4, 4, 64), (6, 2, 128), (8, 2, 64)], ids=str)
def test_extend_matches_reference_on_mixed_batch(block_size, dtype, heads):
    shapes = [(20, 1), (0, 21), (33, 7), (5, 1), (block_size, 18)]
    _extend(dtype, shapes, heads, block_size, seed=heads[0] + heads[2] + block_size)


@block_sizes
@dtypes
def test_extend_long_contexts(block_size, dtype):
    """An 8k-token prefill, 512 new tokens over 7,680 cached, and a decode at 8,191 in one batch."""
    shapes = [(0, 8192), (7680, 512), (8190, 1)]
    _extend(dtype, shapes, (8, 2, 128), block_size, seed=7680 + block_size)


@block_sizes
@dtypes
def test_extend_256_sequences(block_size, dtype):
    rng = random.Random(1000 + block_size)
    shapes = [(rng.choice([0, rng.randrange(1, 300)]), rng.randrange(1, 33)) for _ in range(256)]
    _extend(dtype, shapes, LLAMA_8B_HEADS, block_size, seed=1000 + block_size)
