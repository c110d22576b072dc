"""Plain-torch references for every Triton kernel in `kernels/`.

They are written for clarity, one sequence at a time, and are the ground truth the
kernel tests compare against. Shapes follow the paged cache layout used everywhere:
`k_cache`, `v_cache`: [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from collections.abc import Sequence

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


def q8_linear_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """`x` [rows, in] times Q8_0 weights in `cpu_ops.q8_linear`'s layout (eight rows interleaved), in
    float64: the activations' Q8 codes times the weights' d·q, each group's integer sum exact."""
    blocks, groups = scales.shape[0], scales.shape[1]
    q = codes.reshape(blocks, groups * 8, 8, 4).transpose(1, 2).reshape(blocks * 8, groups, 32)[:out_features]
    d = scales.transpose(1, 2).reshape(blocks * 8, groups)[:out_features].double()
    qx, dx = q8_activations_reference(x)
    sums = torch.einsum("rgi,ogi->rog", qx.double(), q.double())  # exact integers
    return (d[None] * dx.double()[:, None] * sums).sum(-1).float()


def q8_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [rows, in] rounded to Q8 blocks as the kernels round it: per 32 inputs d = max|x| / 127 and
    codes round(x / d) (x times float32's 1 / d, to nearest even). (codes [rows, in / 32, 32], d [rows, in / 32]),
    both float32 holding the exact values; every step is float32's own, so the codes are the kernel's."""
    groups = x.float().reshape(x.shape[0], -1, 32)
    d = groups.abs().amax(-1) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(groups * inverse[..., None]).clamp(-127, 127), d


def unpack_q4_1(codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> tuple[torch.Tensor, ...]:
    """`cpu_ops.q4_1_linear`'s layout (eight rows interleaved) back to rows: codes [out, in] (0..15),
    d and m [out, in / 32], each as it was packed."""
    blocks, groups = scales.shape[0], scales.shape[1]
    units = codes.reshape(blocks, groups * 4, 8, 4)  # [block, unit, row, j]
    q = torch.stack([units & 0x0F, units >> 4], dim=3)  # [block, unit, row, low|high, j]: inputs j, j + 4
    q = q.permute(0, 2, 1, 3, 4).reshape(blocks * 8, groups * 32)[:out_features]
    d = scales[:, :, 0].permute(0, 2, 1).reshape(blocks * 8, groups)[:out_features]
    m = scales[:, :, 1].permute(0, 2, 1).reshape(blocks * 8, groups)[:out_features]
    return q, d, m


def q4_1_linear_reference(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int
) -> torch.Tensor:
    """`x` [rows, in] times Q4_1 weights in `cpu_ops.q4_1_linear`'s layout, in float64: the
    activations' Q8 codes times the weights' d·q + m, each group's integer sum exact."""
    q, d, m = (t.double() for t in unpack_q4_1(codes, scales, out_features))
    qx, dx = q8_activations_reference(x)
    sums = torch.einsum("rgi,ogi->rog", qx.double(), q.reshape(out_features, -1, 32))  # exact integers
    sx = dx.double() * qx.double().sum(-1)
    return (d[None] * dx.double()[:, None] * sums + m[None] * sx[:, None]).sum(-1).float()


def lora_add_reference(
    x: torch.Tensor,
    row_slots: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor | None,
    columns: Sequence[int],
    scaling: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """`cpu_ops.lora_add`, one row and one projection at a time, in float64: row t under slot s =
    `row_slots[t]` (-1: left as it is) gets, in the columns [columns[p], columns[p + 1]) of each projection p
    with rows (ranks[s, p] of them, after the earlier projections' rows of `a`; its block of `b` after
    theirs), scaling[s] * ((x[t] @ a_p.T) @ b_p), added to out[t] and rounded once to out's dtype.
    `ranks` None: one projection of every stacked row; `columns` empty: every column."""
    bounds = list(columns) or [0, out.shape[1]]
    for t, slot in enumerate(row_slots.tolist()):
        if slot < 0:
            continue
        counts = [a.shape[1]] if ranks is None else ranks[slot].tolist()
        row = out[t].double()
        first = offset = 0
        for p, count in enumerate(counts):
            width = bounds[p + 1] - bounds[p]
            block = b[slot, offset : offset + count * width].reshape(count, width)
            if count:  # no rows: the projection's columns keep their bits (even a zero's sign)
                shrunk = x[t].double() @ a[slot, first : first + count].double().T
                row[bounds[p] : bounds[p + 1]] += (shrunk @ block.double()) * float(scaling[slot])
            first, offset = first + count, offset + count * width
        out[t] = row.to(out.dtype)
