"""Bytes and FLOPs of one model step, for the fractions of HBM bandwidth and of matmul peak.

Decode is memory-bound: a step reads every weight once (the embedding only for the batch's
rows) and every cached K/V of every sequence, and writes the new tokens' K/V. Prefill is
compute-bound: 2 FLOPs per weight per token through the layers, the lm_head for the one
sampled row per sequence, and causal attention (QK^T and PV, each 2 FLOPs per query/key
pair per head dimension, over half the square on average).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StepCost:
    """Per-layer and whole-model sizes read from the executor's ModelConfig."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layer_matmul_params: int
    """q, k, v, o, gate, up, down of one layer."""
    element_bytes: int

    @classmethod
    def of(cls, model_config: Any, element_bytes: int) -> StepCost:
        c = model_config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
        return cls(
            c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size, per_layer, element_bytes
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.element_bytes

    @property
    def weight_bytes_per_step(self) -> int:
        """Layer matrices, norms and the lm_head: read once per step whatever the batch."""
        norms = (2 * self.layers + 1) * self.hidden
        return (self.layers * self.layer_matmul_params + self.vocab * self.hidden + norms) * self.element_bytes

    def decode_bytes(self, batch: int, context: int) -> int:
        """HBM traffic of one decode step of `batch` sequences at `context` cached tokens each."""
        embedding_rows = batch * self.hidden * self.element_bytes
        kv_read = batch * context * self.kv_bytes_per_token
        kv_write = batch * self.kv_bytes_per_token
        return self.weight_bytes_per_step + embedding_rows + kv_read + kv_write

    def prefill_flops(self, sequences: int, prompt_len: int) -> float:
        """FLOPs of one step prefilling `sequences` fresh prompts of `prompt_len` tokens."""
        tokens = sequences * prompt_len
        linear = 2.0 * self.layers * self.layer_matmul_params * tokens
        lm_head = 2.0 * self.vocab * self.hidden * sequences
        pairs = sequences * prompt_len * (prompt_len + 1) / 2
        attention = 2 * 2.0 * self.layers * self.heads * self.head_dim * pairs
        return linear + lm_head + attention
