"""KV capacity arithmetic: how many tokens and sequences a memory budget holds.

Pure functions over a Hugging Face config dict, used by `kvserve kv-plan` and by tests.
Each token stores one K and one V vector per layer and KV head:
bytes/token = 2 × layers × kv_heads × head_dim × bytes per element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 2**30

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "fp8": 1}


@dataclass(slots=True)
class KvGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> KvGeometry:
        """Read layers, KV heads (GQA-aware) and head dim from a `config.json` dict."""
        try:
            layers = int(config["num_hidden_layers"])
            heads = int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        except KeyError as exc:
            raise ValueError(f"config.json lacks {exc.args[0]!r}; is this a Llama-family model?") from exc
        return cls(layers, kv_heads, head_dim)


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


def bytes_per_token(geometry: KvGeometry, dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return 2 * geometry.num_layers * geometry.num_kv_heads * geometry.head_dim * DTYPE_BYTES[dtype]


def plan_kv(geometry: KvGeometry, kv_memory_bytes: int, block_size: int, dtype: str, avg_context: int) -> KvPlan:
    if block_size < 1 or avg_context < 1 or kv_memory_bytes < 0:
        raise ValueError("block_size and avg_context must be positive and kv memory non-negative")
    per_token = bytes_per_token(geometry, dtype)
    block_bytes = per_token * block_size
    num_blocks = kv_memory_bytes // block_bytes
    blocks_per_seq = -(-avg_context // block_size)
    tail_waste = block_size / 2
    return KvPlan(
        bytes_per_token=per_token, block_bytes=block_bytes, num_blocks=num_blocks,
        token_capacity=num_blocks * block_size, max_concurrency=num_blocks // blocks_per_seq,
        fragmentation_pct=100.0 * tail_waste / (avg_context + tail_waste),
        block_size=block_size, avg_context=avg_context, kv_memory_bytes=kv_memory_bytes,
    )
