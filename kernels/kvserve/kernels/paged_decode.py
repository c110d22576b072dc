"""Triton paged decode attention: split-K (flash-decoding) over KV blocks.

One program handles one (sequence, KV head, split): the query heads that share the KV
head are packed into the rows of one tile (GQA packing), so each K/V block is read from
memory once per KV head rather than once per query head. Each split runs an online
softmax over its range of KV tiles (`kvserve.kernels.kv_tile`: one block, or two 8-token blocks)
and writes a partial output plus its log-sum-exp; a second kernel merges the splits.
Splitting the context keeps the GPU busy when the batch is small but contexts are long.

The split count follows the batch size and the KV heads alone, and each sequence cuts its own
context into that many equal runs of tiles in the kernel, from the length it reads on the device.
So the host never reads the step's lengths: one launch serves every context, which a CUDA graph
needs (`kvserve.executor.model.cuda_graphs`), and a row's arithmetic depends on its own length and
the batch size, not on the longest context beside it (a graph and an eager step of the same batch
size compute the same bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.kv_tile import kv_tile_tokens, tile_slots


@triton.jit
def _decode_split_kernel(  # type: ignore[no-untyped-def]  # Triton JIT: untyped by nature
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    scale,
    stride_q_b,
    stride_q_h,
    stride_bt_b,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)  # this sequence's own share: every split has work
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, num_tiles)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = tl.load(
        q_ptr + seq * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :], mask=g_mask[:, None], other=0.0
    )

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    token_stride = KV_HEADS * HEAD_DIM
    for tile in range(first, last):
        slots, pos = tile_slots(block_table_ptr + seq * stride_bt_b, tile, seq_len, BLOCK_SIZE, TILE_N)
        kv_offs = slots[:, None] * token_stride + kv_head * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_offs)
        v = tl.load(v_cache_ptr + kv_offs)
        scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        scores = tl.where(pos[None, :] < seq_len, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new

    has_work = l_i > 0
    out = acc / tl.where(has_work, l_i, 1.0)[:, None]
    lse = tl.where(has_work, m_i + tl.log(tl.where(has_work, l_i, 1.0)), float("-inf"))
    row = (seq * KV_HEADS * GROUP + heads) * NUM_SPLITS + split
    tl.store(out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=g_mask[:, None])
    tl.store(lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(  # type: ignore[no-untyped-def]  # Triton JIT: untyped by nature
    part_ptr,
    lse_ptr,
    out_ptr,
    stride_o_b,
    stride_o_h,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < NUM_SPLITS
    base = (seq * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    part = tl.load(part_ptr + (base + offs_s[:, None]) * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(part * weights[:, None], 0)
    tl.store(out_ptr + seq * stride_o_b + head * stride_o_h + offs_d, out.to(out_ptr.dtype.element_ty))


TARGET_PROGRAMS = {"cuda": 256}
"""Split programs a launch aims for: enough to fill a GPU. Elsewhere (the Triton interpreter, tests
without a GPU, which runs programs one at a time) `TARGET_PROGRAMS_ELSEWHERE`."""
TARGET_PROGRAMS_ELSEWHERE = 8
MAX_SPLITS = 64


def choose_num_splits(num_seqs: int, kv_heads: int, device_type: str = "cuda") -> int:
    """Enough splits to fill the device at this batch size; a split past a sequence's tiles exits at once."""
    target = TARGET_PROGRAMS.get(device_type, TARGET_PROGRAMS_ELSEWHERE)
    return max(1, min(triton.cdiv(target, max(1, num_seqs * kv_heads)), MAX_SPLITS))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence. `query`: [B, num_heads, head_dim]; returns the same shape."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    tile_n = kv_tile_tokens(block_size)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, kv_heads, query.device.type)
    out = torch.empty_like(query) if out is None else out
    if num_seqs == 0:
        return out
    part = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    assert query.stride(2) == 1
    _decode_split_kernel[(num_seqs, kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part,
        lse,
        scale,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        KV_HEADS=kv_heads,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
    )
    _merge_splits_kernel[(num_seqs, num_heads)](
        part,
        lse,
        out,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
    )
    return out
