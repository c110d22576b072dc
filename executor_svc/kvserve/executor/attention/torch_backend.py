"""Attention in plain torch: gather through block tables, then batched attention.

The CPU default and the reference the Triton path is checked against. Sequences with the
same number of new tokens form one group; decodes are further split into context-length
buckets (`context_buckets`), so short contexts are not padded to the longest one. A group's
keys are gathered through the block tables in one `index_select`, padded to its longest
context, and a mask hides padding and the causal future. Decode groups score with one
batched matmul and sum values with `embedding_bag` straight from the cache (no copy of V);
prefill/extend groups use `scaled_dot_product_attention`. There is no Python loop over
blocks, and the gather indices and masks are built once per step and shared by every layer.

On CPU this path is memory-bound: a decode step reads every context key and value of every
layer. Gathered K/V land in a workspace owned by the backend and reused by every layer and
step: a fresh multi-megabyte tensor per layer costs page faults on first touch, which
measured as much as the copy itself (index_select into a reused buffer: 1.5 vs 2.6 ms for
a 32 x 768-token layer on one core).

A `--kv-cache-dtype` narrower than the activations stores K/V rounded (`store_kv`) and widens
gathered K (and prefill's V) to the activation dtype; decode sums V in the cache's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.executor.attention.base import SLOT_MAJOR, AttentionMetadata

CONTEXT_BUCKET_RATIO = 0.7
"""A decode sequence joins the current group while its context is at least this fraction of the
group's longest: at most ~30% of each group's gathered keys are padding."""
MIN_BUCKET_SEQS = 4
"""Smaller groups are not split off: below this, per-group op overhead outweighs the padding saved."""
MAX_BUCKETS = 6


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
    value_bags: torch.Tensor | None = None
    """Decode groups: [n * num_heads, keys] value rows each query head sums over (its kv head's
    rows), built by the first layer that needs it and reused by the rest."""

    def decode_value_bags(self, num_heads: int) -> torch.Tensor:
        if self.value_bags is None:
            rows = self.kv_rows.view(self.num_seqs, -1, 1, self.num_keys)
            kv_heads = rows.shape[1]
            self.value_bags = rows.expand(-1, -1, num_heads // kv_heads, -1).reshape(-1, self.num_keys)
        return self.value_bags


class TorchAttentionBackend:
    name = "torch"
    kv_layout = SLOT_MAJOR

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        by_len: dict[int, list[int]] = {}
        for i, q_len in enumerate(meta.query_lens_cpu):
            by_len.setdefault(q_len, []).append(i)
        groups = [
            (q_len, bucket)
            for q_len, seqs in by_len.items()
            for bucket in (context_buckets(seqs, meta.seq_lens_cpu) if q_len == 1 else [seqs])
        ]
        device = meta.block_tables.device
        whole_batch = len(groups) == 1
        starts = [] if whole_batch else meta.query_start_loc.tolist()
        meta.prepared = [self._group(meta, seqs, q_len, starts, device, whole_batch) for q_len, seqs in groups]

    @staticmethod
    def _group(
        meta: AttentionMetadata, seqs: list[int], q_len: int, starts: list[int], device: torch.device, whole_batch: bool
    ) -> _Group:
        block_size = meta.block_size
        seq_lens = [meta.seq_lens_cpu[i] for i in seqs]
        num_blocks = -(-max(seq_lens) // block_size)
        tables = (
            meta.block_tables
            if whole_batch
            else meta.block_tables.index_select(0, torch.tensor(seqs, dtype=torch.long, device=device))
        )
        block_index = tables[:, :num_blocks].long()
        lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
        k_pos = torch.arange(num_blocks * block_size, device=device)
        q_pos = (lens - q_len)[:, None] + torch.arange(q_len, device=device)[None, :]  # [n, q_len]
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < lens[:, None, None])
        kv_heads = meta.num_kv_heads
        slots = block_index[:, :, None] * block_size + torch.arange(block_size, device=device)
        kv_rows = (
            slots.reshape(len(seqs), 1, -1) * kv_heads + torch.arange(kv_heads, device=device)[None, :, None]
        ).reshape(-1)
        token_index = None
        if not whole_batch:
            token_index = (
                (torch.tensor([starts[i] for i in seqs], dtype=torch.long)[:, None] + torch.arange(q_len)[None, :])
                .reshape(-1)
                .to(device)
            )
        mask = mask.unsqueeze(1)
        additive = None
        if q_len == 1:
            additive = torch.zeros(mask.shape, dtype=meta.dtype, device=device).masked_fill_(~mask, float("-inf"))
        return _Group(
            token_index=token_index,
            kv_rows=kv_rows,
            num_keys=num_blocks * block_size,
            mask=mask,
            additive_mask=additive,
            num_seqs=len(seqs),
            query_len=q_len,
        )

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value.to(v_cache.dtype))

    def forward(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_heads, head_dim = query.shape[1], query.shape[2]
        out = None
        for group in meta.prepared:
            n, q_len = group.num_seqs, group.query_len
            q = query if group.token_index is None else query.index_select(0, group.token_index)
            size = group.kv_rows.numel() * head_dim
            buffer = self._workspace_view(size if q_len == 1 else 2 * size, k_cache)  # K, or K and V
            k = _gather(k_cache, group.kv_rows, n, group.num_keys, buffer[:size]).to(query.dtype)
            if q_len == 1:
                o = _decode_attention(
                    q, k, v_cache, group.decode_value_bags(num_heads), group.additive_mask, meta.scale
                )
            else:
                v = _gather(v_cache, group.kv_rows, n, group.num_keys, buffer[size:]).to(query.dtype)
                q = q.view(n, q_len, num_heads, head_dim).transpose(1, 2)
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=group.mask, scale=meta.scale, enable_gqa=k.shape[1] != num_heads
                )
                o = o.transpose(1, 2).reshape(n * q_len, num_heads, head_dim)
            if group.token_index is None:
                return o
            if out is None:
                out = torch.empty_like(query)
            out.index_copy_(0, group.token_index, o)
        assert out is not None  # a step has a sequence, so `prepared` has a group
        return out

    def _workspace_view(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat view of `numel` elements of the reused workspace, grown on demand. It keeps the
        largest gather seen (what one layer used to allocate and free each time)."""
        ws = self._workspace
        if ws is None or ws.numel() < numel or ws.dtype != like.dtype or ws.device != like.device:
            ws = self._workspace = torch.empty(numel, dtype=like.dtype, device=like.device)
        return ws[:numel]


def context_buckets(seqs: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Split decode sequences into groups whose contexts are within CONTEXT_BUCKET_RATIO of the
    group's longest, so no group pads many short contexts to a long one.

    Attention reads every padded key, so with contexts spread from 100 to 800 tokens one
    group would gather about 1.7x the keys that exist; one extra group costs only a few
    small ops per layer. Buckets are cut greedily from the longest context down.
    """
    if len(seqs) < 2 * MIN_BUCKET_SEQS:
        return [seqs]
    order = sorted(seqs, key=lambda i: seq_lens[i], reverse=True)
    buckets: list[list[int]] = [[]]
    longest = seq_lens[order[0]]
    for i in order:
        if (
            seq_lens[i] < longest * CONTEXT_BUCKET_RATIO
            and len(buckets[-1]) >= MIN_BUCKET_SEQS
            and len(buckets) < MAX_BUCKETS
        ):
            buckets.append([])
            longest = seq_lens[i]
        buckets[-1].append(i)
    if len(buckets) > 1 and len(buckets[-1]) < MIN_BUCKET_SEQS:
        buckets[-2].extend(buckets.pop())
    return [sorted(b) for b in buckets]


def _gather(
    cache: torch.Tensor, kv_rows: torch.Tensor, num_seqs: int, num_keys: int, buffer: torch.Tensor
) -> torch.Tensor:
    """[n, kv_heads, keys, head_dim], contiguous: the layout attention wants, in one index_select."""
    kv_heads, head_dim = cache.shape[2], cache.shape[3]
    out = buffer.view(-1, head_dim)
    torch.index_select(cache.view(-1, head_dim), 0, kv_rows, out=out)
    return out.view(num_seqs, kv_heads, num_keys, head_dim)


def _decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v_cache: torch.Tensor,
    value_bags: torch.Tensor,
    additive_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence. Scores: the GQA heads of a KV head packed as rows of one small
    batched matmul over the gathered K. Output: `embedding_bag` sums each head's value rows
    weighted by its probabilities straight from the cache, with no gathered copy of V
    (measured 2.4 vs 1.1 ms for a 32 x 768-token layer on one core); padded keys have
    probability exactly 0.
    """
    n, num_heads, head_dim = q.shape
    kv_heads, num_keys = k.shape[1], k.shape[2]
    group = num_heads // kv_heads
    qg = q.reshape(n * kv_heads, group, head_dim)
    scores = torch.bmm(qg, k.view(n * kv_heads, num_keys, head_dim).transpose(1, 2))
    scores = scores.view(n, kv_heads, group, num_keys).mul_(scale).add_(additive_mask)
    probs = scores.softmax(dim=-1).view(n * num_heads, num_keys)
    weights = probs.to(v_cache.dtype)  # a narrower --kv-cache-dtype: V is summed in its own dtype
    out = F.embedding_bag(value_bags, v_cache.view(-1, head_dim), mode="sum", per_sample_weights=weights)
    return out.view(n, num_heads, head_dim).to(q.dtype)
