"""The attention backend interface and the per-step metadata every backend reads.

A backend is asked once per step to `prepare` (precompute masks, index tensors or
kernel launch parameters shared by every layer), then once per layer to `store_kv`
and `forward`. Keeping per-step work out of the per-layer path is what makes small
decode batches cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

SLOT_MAJOR = "slot-major"
"""K and V blocks `[num_blocks, block_size, num_kv_heads, head_dim]` (the torch and triton backends)."""
HEAD_MAJOR = "head-major"
"""K blocks `[num_blocks, num_kv_heads, head_dim, block_size]` and V `[num_blocks, num_kv_heads, block_size,
head_dim]` (the cpu backend): one head's block a contiguous run, keys transposed (`kvserve.executor.model.kv_cache`)."""


@dataclass(slots=True)
class AttentionMetadata:
    """Flattened batch geometry: sequences packed back to back, no padding."""

    slot_mapping: torch.Tensor
    """[num_tokens] int64: cache slot of each new token (block * block_size + offset)."""
    query_start_loc: torch.Tensor
    """[num_seqs + 1] int32 offsets of each sequence's new tokens in the packed batch."""
    seq_lens: torch.Tensor
    """[num_seqs] int32: context length after this step (cached + new tokens)."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks] int32, padded with block 0."""
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    scale: float
    block_size: int
    num_kv_heads: int = 0
    dtype: torch.dtype = torch.float32
    """Activation dtype (masks are built in it)."""
    prepared: Any = field(default=None)
    """Backend-private state built by `prepare` and reused by every layer."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(Protocol):
    name: str
    kv_layout: str
    """The order of a KV block's elements this backend reads and writes (`kvserve.executor.model.kv_cache`)."""

    def prepare(self, meta: AttentionMetadata) -> None:
        """Precompute what every layer of this step shares; stores it in `meta.prepared`."""
        ...

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Write the new tokens' K/V ([T, kv_heads, head_dim]) into the paged cache."""
        ...

    def forward(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Attention output [T, num_heads, head_dim] for the packed queries, after store_kv."""
        ...
