"""Attention through the Triton kernels in `kernels/` (the CUDA default).

Pure-decode steps use the split-K paged decode kernel; any step with a prefill or
extend chunk uses the varlen extend kernel for the whole packed batch (a decode is the
one-token case of an extend).
"""

from __future__ import annotations

import torch

from kvserve.executor.attention.base import SLOT_MAJOR, AttentionMetadata
from kvserve.kernels.paged_decode import paged_decode_attention
from kvserve.kernels.prefill_extend import extend_attention
from kvserve.kernels.store_kv import store_kv


class TritonAttentionBackend:
    name = "triton"
    kv_layout = SLOT_MAJOR

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.prepared = None

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)

    def forward(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if meta.max_query_len == 1:
            return paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.scale)
        return extend_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            meta.scale,
            max_query_len=meta.max_query_len,
        )
