"""Plain-torch references for every Triton kernel in `kernels/`.

They are written for clarity, one sequence at a time, and are the ground truth the
kernel tests compare against. Shapes follow the paged cache layout used everywhere:
`k_cache`, `v_cache`: [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import torch


def store_kv_reference(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write token t's K/V ([T, kv_heads, head_dim]) to slot `slot_mapping[t]`; slots < 0 are skipped."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[t]
        v_cache[slot // block_size, slot % block_size] = value[t]


def gather_sequence_kv(cache: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    """The first `seq_len` cached positions of one sequence, [seq_len, kv_heads, head_dim]."""
    blocks = cache[torch.tensor(block_table, dtype=torch.long)]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed new tokens over each sequence's paged context.

    `query` is [num_tokens, num_heads, head_dim], packed by sequence (`query_start_loc`
    has num_seqs + 1 offsets). Sequence i's new tokens are its last q_len positions of
    `seq_lens[i]`; their own K/V must already be in the cache. A decode step is the
    q_len == 1 case, a fresh prefill the context == 0 case.
    """
    out = torch.empty_like(query)
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len = end - start
        k = gather_sequence_kv(k_cache, block_tables[i], seq_len).float()
        v = gather_sequence_kv(v_cache, block_tables[i], seq_len).float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[start:end].float().transpose(0, 1)  # [H, q_len, D]
        scores = q @ k.transpose(1, 2) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ v).transpose(0, 1).to(query.dtype)
    return out


def q8_linear_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`x` [rows, in] times Q8_0 weights (int8 `codes` [out, in], `scales` [out, in / 32]), in float64."""
    weight = codes.double().reshape(codes.shape[0], -1, 32) * scales.double()[..., None]
    return (x.double() @ weight.reshape(codes.shape).t()).float()


def q4_1_linear_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`x` [rows, in] times Q4_1 weights (`cpu_ops.q4_1_linear`'s packed `codes` and (d, m) `scales`), in float64."""
    out_features, groups = scales.shape[0], scales.shape[1]
    packed = codes.reshape(out_features, groups, 16).long()
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).double()  # [out, groups, 32] in input order
    weight = q * scales[..., 0:1].double() + scales[..., 1:2].double()
    return (x.double() @ weight.reshape(out_features, groups * 32).t()).float()
