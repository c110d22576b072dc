"""Attention in plain torch: gather through block tables, then batched attention.

The CPU default and the reference the Triton path is checked against. Sequences with the
same number of new tokens form one group (all decodes of a step are a single group);
a group's contexts are gathered through the block tables in one `index_select`, padded
to its longest context, and a mask hides padding and the causal future. Decode groups
use two batched matmuls; prefill/extend groups use `scaled_dot_product_attention`.
There is no Python loop over blocks, and the gather indices and masks are built once per
step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor_svc.attention.base import AttentionMetadata


@dataclass(slots=True)
class _Group:
    """Sequences sharing a query length, attended in one batched call."""

    token_index: torch.Tensor | None
    """Packed rows of the group's queries, or None when the group is the whole batch in order."""
    kv_rows: torch.Tensor
    """Rows of the cache viewed as [slots * kv_heads, head_dim], ordered [n, kv_heads, keys]."""
    num_keys: int
    mask: torch.Tensor
    """[n, 1, q_len, blocks * block_size] True where a key is visible."""
    additive_mask: torch.Tensor | None
    """Decode groups only: the same mask as 0 / -inf, [n, 1, 1, keys]."""
    num_seqs: int
    query_len: int


class TorchAttentionBackend:
    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        by_len: dict[int, list[int]] = {}
        for i, q_len in enumerate(meta.query_lens_cpu):
            by_len.setdefault(q_len, []).append(i)
        device = meta.block_tables.device
        starts = meta.query_start_loc.tolist()
        groups = []
        for q_len, seqs in by_len.items():
            groups.append(self._group(meta, seqs, q_len, starts, device, len(by_len) == 1))
        meta.prepared = groups

    @staticmethod
    def _group(meta: AttentionMetadata, seqs: list[int], q_len: int, starts: list[int],
               device: torch.device, whole_batch: bool) -> _Group:
        block_size = meta.block_size
        seq_lens = [meta.seq_lens_cpu[i] for i in seqs]
        num_blocks = -(-max(seq_lens) // block_size)
        rows = torch.tensor(seqs, dtype=torch.long, device=device)
        block_index = meta.block_tables.index_select(0, rows)[:, :num_blocks].long()
        lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
        k_pos = torch.arange(num_blocks * block_size, device=device)
        q_pos = (lens - q_len)[:, None] + torch.arange(q_len, device=device)[None, :]  # [n, q_len]
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < lens[:, None, None])
        kv_heads = meta.num_kv_heads
        slots = block_index[:, :, None] * block_size + torch.arange(block_size, device=device)
        kv_rows = (slots.reshape(len(seqs), 1, -1) * kv_heads
                   + torch.arange(kv_heads, device=device)[None, :, None]).reshape(-1)
        token_index = None
        if not whole_batch:
            token_index = (torch.tensor([starts[i] for i in seqs], dtype=torch.long)[:, None]
                           + torch.arange(q_len)[None, :]).reshape(-1).to(device)
        mask = mask.unsqueeze(1)
        additive = None
        if q_len == 1:
            additive = torch.zeros(mask.shape, dtype=meta.dtype, device=device).masked_fill_(~mask, float("-inf"))
        return _Group(token_index=token_index, kv_rows=kv_rows, num_keys=num_blocks * block_size, mask=mask,
                      additive_mask=additive, num_seqs=len(seqs), query_len=q_len)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_heads, head_dim = query.shape[1], query.shape[2]
        out = None
        for group in meta.prepared:
            n, q_len = group.num_seqs, group.query_len
            q = query if group.token_index is None else query.index_select(0, group.token_index)
            k = _gather(k_cache, group.kv_rows, n, group.num_keys)
            v = _gather(v_cache, group.kv_rows, n, group.num_keys)
            if q_len == 1:
                o = _decode_attention(q, k, v, group.additive_mask, meta.scale)
            else:
                q = q.view(n, q_len, num_heads, head_dim).transpose(1, 2)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=meta.scale,
                                                   enable_gqa=k.shape[1] != num_heads)
                o = o.transpose(1, 2).reshape(n * q_len, num_heads, head_dim)
            if group.token_index is None:
                return o
            if out is None:
                out = torch.empty_like(query)
            out.index_copy_(0, group.token_index, o)
        return out


def _gather(cache: torch.Tensor, kv_rows: torch.Tensor, num_seqs: int, num_keys: int) -> torch.Tensor:
    """[n, kv_heads, keys, head_dim], contiguous: the layout attention wants, in one index_select."""
    kv_heads, head_dim = cache.shape[2], cache.shape[3]
    return cache.view(-1, head_dim).index_select(0, kv_rows).view(num_seqs, kv_heads, num_keys, head_dim)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, additive_mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One query per sequence, the GQA heads of a KV head packed as rows of one small matmul.

    On CPU two batched matmuls over contiguous gathered K/V beat SDPA, which pays
    per-call set-up for single-row tiles.
    """
    n, num_heads, head_dim = q.shape
    kv_heads, num_keys = k.shape[1], k.shape[2]
    group = num_heads // kv_heads
    qg = q.reshape(n * kv_heads, group, head_dim)
    scores = torch.bmm(qg, k.view(n * kv_heads, num_keys, head_dim).transpose(1, 2))
    scores = scores.view(n, kv_heads, group, num_keys).mul_(scale).add_(additive_mask)
    probs = scores.softmax(dim=-1).view(n * kv_heads, group, num_keys)
    return torch.bmm(probs, v.view(n * kv_heads, num_keys, head_dim)).view(n, num_heads, head_dim)
