"""Triton prefill/extend attention over a paged cache, varlen-packed.

New tokens of many sequences are packed back to back (`query_start_loc`), with no
padding. A program owns one tile of BLOCK_M new tokens of one sequence and one query
head. The new tokens' K/V are stored into the cache before this kernel runs, so one
loop over the block table, a KV tile at a time (`kvserve.kernels.kv_tile`: one block, or two
8-token blocks), covers both the cached context (fully visible) and the causal part over
the new tokens (masked by position); the loop stops at the tile's last query position,
so causal work above the diagonal is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.kv_tile import kv_tile_tokens, tile_slots


@triton.jit
def _extend_kernel(  # type: ignore[no-untyped-def]  # Triton JIT: untyped by nature
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_table_ptr,
    query_start_ptr,
    seq_lens_ptr,
    scale,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_bt_b,
    GROUP: tl.constexpr,
    KV_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len
    kv_head = head // GROUP

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :], mask=m_mask[:, None], other=0.0
    )
    q_pos = context + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv_end = tl.minimum(seq_len, context + (tile + 1) * BLOCK_M)
    token_stride = KV_HEADS * HEAD_DIM
    for kv_tile in range(tl.cdiv(kv_end, TILE_N)):
        slots, k_pos = tile_slots(block_table_ptr + seq * stride_bt_b, kv_tile, seq_len, BLOCK_SIZE, TILE_N)
        kv_offs = slots[:, None] * token_stride + kv_head * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_offs)
        v = tl.load(v_cache_ptr + kv_offs)
        scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_o_t + head * stride_o_h + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None],
    )


def extend_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    block_m: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed new tokens `query` [T, num_heads, head_dim] attend their sequences' caches."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty_like(query) if out is None else out
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0:
        return out
    if block_m is None:
        block_m = 16 if not query.is_cuda else 64
    assert query.stride(2) == 1
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _extend_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=num_heads // kv_heads,
        KV_HEADS=kv_heads,
        BLOCK_M=block_m,
        BLOCK_SIZE=block_size,
        TILE_N=kv_tile_tokens(block_size),
        HEAD_DIM=head_dim,
    )
    return out
