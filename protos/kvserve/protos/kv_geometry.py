"""KV cache geometry: how many bytes one token's K and V take, for both processes.

`kvserve kv-plan` (scheduler side) and the executor's `PagedKVCache` size memory with this
one formula. Each token stores one K and one V vector per layer and KV head:
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


def bytes_per_token(geometry: KvGeometry, dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return 2 * geometry.num_layers * geometry.num_kv_heads * geometry.head_dim * DTYPE_BYTES[dtype]
