"""Triton kernels against their torch references (interpreter on CPU, real kernels on CUDA).

Shapes are small because the interpreter runs each program in Python; they still cover
shuffled non-contiguous block tables, lengths that are not block multiples (including 1) and
exact multiples, GQA ratios 1/3/4, head_dim 64/128, and mixed decode + prefill-with-context
batches, each at every block size `--block-size` accepts (kvserve.config.defaults.BLOCK_SIZES).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvserve.config.defaults import BLOCK_SIZES
from kvserve.kernels.reference import paged_attention_reference, store_kv_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
block_sizes = pytest.mark.parametrize("block_size", BLOCK_SIZES)


def _random_paged_cache(seq_lens: list[int], kv_heads: int, head_dim: int, gen: torch.Generator, block_size: int):
    """A cache with random contents and shuffled, disjoint block tables per sequence."""
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 5
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in blocks_needed:
        tables.append(perm[used : used + n])
        used += n
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    width = max(blocks_needed)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, tables, padded


def _to(*tensors):
    return [t.to(DEVICE) for t in tensors]


@block_sizes
def test_store_kv_matches_reference_and_skips_negative_slots(block_size):
    from kvserve.kernels.store_kv import store_kv

    gen = torch.Generator().manual_seed(0)
    num_blocks, kv_heads, head_dim = 96 // block_size + 1, 3, 64
    slots = torch.tensor([17, 3, -1, 95, 40, 0], dtype=torch.int64)
    fused = torch.randn(len(slots), 2 * kv_heads * head_dim + 8, generator=gen)  # strided views, like qkv
    key = fused[:, : kv_heads * head_dim].view(-1, kv_heads, head_dim)
    value = fused[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(-1, kv_heads, head_dim)
    expected_k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    expected_v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    untouched = expected_k.clone()
    k_cache, v_cache = _to(expected_k.clone(), expected_v.clone())
    store_kv_reference(key, value, expected_k, expected_v, slots)
    store_kv(*_to(key, value), k_cache, v_cache, slots.to(DEVICE))
    torch.testing.assert_close(k_cache.cpu(), expected_k)
    torch.testing.assert_close(v_cache.cpu(), expected_v)
    torch.testing.assert_close(k_cache.cpu()[95 // block_size, 95 % block_size], key[3])  # slot 95: token 3
    others = [s for s in range(num_blocks * block_size) if s not in slots.tolist()]  # every other slot: kept
    torch.testing.assert_close(
        k_cache.cpu().view(-1, kv_heads, head_dim)[others], untouched.view(-1, kv_heads, head_dim)[others]
    )


@block_sizes
@pytest.mark.parametrize("num_heads,kv_heads,head_dim", [(4, 4, 64), (6, 2, 64), (8, 2, 128)])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_paged_decode_matches_reference(num_heads, kv_heads, head_dim, num_splits, block_size):
    """8 splits: more than the shorter sequences have tiles, so some splits of a sequence are empty."""
    from kvserve.kernels.paged_decode import paged_decode_attention

    gen = torch.Generator().manual_seed(num_heads * 100 + head_dim + num_splits + block_size)
    # one token, exactly one block, partial last blocks; 70 spans two blocks even at 64
    seq_lens = [1, block_size, 37, 70]
    k_cache, v_cache, tables, padded = _random_paged_cache(seq_lens, kv_heads, head_dim, gen, block_size)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    expected = paged_attention_reference(
        query, k_cache, v_cache, list(range(len(seq_lens) + 1)), seq_lens, tables, scale
    )
    got = paged_decode_attention(
        *_to(query, k_cache, v_cache, padded),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        scale,
        num_splits=num_splits,
    )
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=1e-4)


@block_sizes
def test_a_decode_row_does_not_depend_on_the_longest_context_beside_it(block_size):
    """Each sequence splits its own context (the kernel reads its length), so at one split count a
    row's bits are the same beside a far longer sequence: what lets one launch, or one CUDA graph,
    serve every context."""
    from kvserve.kernels.paged_decode import paged_decode_attention

    gen = torch.Generator().manual_seed(block_size)
    seq_lens, num_heads, kv_heads, head_dim = [37, 70, 12 * block_size + 3], 6, 2, 64
    k_cache, v_cache, tables, padded = _random_paged_cache(seq_lens, kv_heads, head_dim, gen, block_size)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    beside_long = torch.tensor([seq_lens[0], seq_lens[1], seq_lens[1]], dtype=torch.int32)
    outputs = [
        paged_decode_attention(*_to(query, k_cache, v_cache, padded, lengths), head_dim**-0.5, num_splits=8).cpu()
        for lengths in (lens, beside_long)
    ]
    assert torch.equal(outputs[0][:2], outputs[1][:2])
    expected = paged_attention_reference(
        query, k_cache, v_cache, list(range(len(seq_lens) + 1)), seq_lens, tables, head_dim**-0.5
    )
    torch.testing.assert_close(outputs[0], expected, atol=2e-5, rtol=1e-4)


@block_sizes
@pytest.mark.parametrize("num_heads,kv_heads,head_dim", [(4, 4, 64), (6, 2, 128), (8, 2, 64)])
def test_extend_matches_reference_on_mixed_batch(num_heads, kv_heads, head_dim, block_size):
    from kvserve.kernels.prefill_extend import extend_attention

    gen = torch.Generator().manual_seed(num_heads + head_dim + block_size)
    # (context already cached, new tokens): decodes, a fresh prefill, extends over context, the
    # last one starting at a block boundary and crossing into the next block.
    shapes = [(20, 1), (0, 21), (33, 7), (5, 1), (block_size, 18)]
    seq_lens = [c + q for c, q in shapes]
    starts = [0]
    for _, q in shapes:
        starts.append(starts[-1] + q)
    k_cache, v_cache, tables, padded = _random_paged_cache(seq_lens, kv_heads, head_dim, gen, block_size)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    expected = paged_attention_reference(query, k_cache, v_cache, starts, seq_lens, tables, scale)
    got = extend_attention(
        *_to(query, k_cache, v_cache, padded),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        scale,
        max_query_len=max(q for _, q in shapes),
    )
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=1e-4)


def test_reference_is_causal():
    """Guards the reference itself: the first new token must ignore later tokens."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables, _ = _random_paged_cache([5], 1, 64, gen, block_size=16)
    query = torch.randn(5, 1, 64, generator=gen)
    out = paged_attention_reference(query, k_cache, v_cache, [0, 5], [5], tables, 0.125)
    first_only = paged_attention_reference(query[:1], k_cache, v_cache, [0, 1], [1], tables, 0.125)
    torch.testing.assert_close(out[:1], first_only)
    v_first = v_cache[tables[0][0], 0]
    torch.testing.assert_close(first_only[0], v_first)


def test_kv_tiles_are_whole_blocks_of_at_least_the_cuda_dot_minimum():
    from kvserve.kernels.kv_tile import MIN_DOT_K, kv_tile_tokens

    assert [kv_tile_tokens(size) for size in BLOCK_SIZES] == [max(MIN_DOT_K, size) for size in BLOCK_SIZES]
    assert kv_tile_tokens(8) == 16 and kv_tile_tokens(64) == 64  # two 8-token blocks; one 64-token block
    with pytest.raises(ValueError, match="power-of-two block size, got 12"):
        kv_tile_tokens(12)


def test_interpreter_applies_the_cuda_dot_rule(cuda_dot_shape_rule):
    """Guards the guard (conftest.py): under the interpreter a dot reducing over 8 elements must fail."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("real kernels: the GPU compiler applies the rule itself")
    assert cuda_dot_shape_rule, "triton.runtime.interpreter changed: update tests/kernels/conftest.py"
    import triton
    import triton.language as tl

    @triton.jit
    def dot_k8(a_ptr, b_ptr, out_ptr):
        offs16, offs8 = tl.arange(0, 16), tl.arange(0, 8)
        a = tl.load(a_ptr + offs16[:, None] * 8 + offs8[None, :])
        b = tl.load(b_ptr + offs8[:, None] * 16 + offs16[None, :])
        tl.store(out_ptr + offs16[:, None] * 16 + offs16[None, :], tl.dot(a, b))

    a, b, out = torch.ones(16, 8), torch.ones(8, 16), torch.empty(16, 16)
    with pytest.raises(Exception, match="K >= 16"):
        dot_k8[(1,)](a, b, out)
