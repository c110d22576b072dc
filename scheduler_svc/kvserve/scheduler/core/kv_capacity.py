"""KV capacity arithmetic: how many tokens and sequences a memory budget holds.

Pure functions used by `kvserve kv-plan` and by tests; the bytes-per-token formula
itself is `kvserve.protos.kv_geometry`, shared with the executor that sizes the real cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.protos.kv_geometry import KvGeometry, bytes_per_token


@dataclass(slots=True)
class KvPlan:
    bytes_per_token: int
    block_bytes: int
    num_blocks: int
    token_capacity: int
    max_concurrency: int
    """Sequences of `avg_context` tokens that fit at once (each rounded up to whole blocks)."""
    fragmentation_pct: float
    """Average tail waste (block_size / 2 tokens per sequence) as a share of the KV a sequence holds."""
    block_size: int
    avg_context: int
    kv_memory_bytes: int


def plan_kv(geometry: KvGeometry, kv_memory_bytes: int, block_size: int, dtype: str, avg_context: int) -> KvPlan:
    if block_size < 1 or avg_context < 1 or kv_memory_bytes < 0:
        raise ValueError("block_size and avg_context must be positive and kv memory non-negative")
    per_token = bytes_per_token(geometry, dtype)
    block_bytes = per_token * block_size
    num_blocks = kv_memory_bytes // block_bytes
    blocks_per_seq = -(-avg_context // block_size)
    tail_waste = block_size / 2
    return KvPlan(
        bytes_per_token=per_token,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        token_capacity=num_blocks * block_size,
        max_concurrency=num_blocks // blocks_per_seq,
        fragmentation_pct=100.0 * tail_waste / (avg_context + tail_waste),
        block_size=block_size,
        avg_context=avg_context,
        kv_memory_bytes=kv_memory_bytes,
    )
