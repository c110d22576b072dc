"""Our own Llama-family forward pass over a flattened, unpadded batch.

Covers Llama, Mistral, Qwen2 (qkv bias) and SmolLM2: RMSNorm, rotary embeddings with
the config's theta and scaling, grouped-query attention through a pluggable paged
attention backend, SwiGLU MLP, tied or untied lm_head. Numerics follow transformers'
reference (RMSNorm in float32, rotate-half RoPE) so greedy tokens match it exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from executor_svc.attention.base import AttentionBackend
from executor_svc.input_batch import InputBatch
from executor_svc.kv_cache import PagedKVCache
from executor_svc.model_config import ModelConfig, RopeConfig
from executor_svc.weights import ModelWeights


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair rotation frequencies, with linear or llama3 scaling applied."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class LlamaModel:
    """Weights + rotary tables; `forward` runs one packed batch and returns sampled-row logits."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, max_model_len: int,
                 device: str, dtype: torch.dtype) -> None:
        self.config = config
        self.weights = weights
        self.dtype = dtype
        inv_freq = rope_inverse_frequencies(config.rope, config.head_dim)
        angles = torch.outer(torch.arange(max_model_len, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(device=device, dtype=dtype)
        self.sin = angles.sin().to(device=device, dtype=dtype)
        self.scale = config.head_dim ** -0.5
        q = config.num_heads * config.head_dim
        kv = config.num_kv_heads * config.head_dim
        self._split = (q, kv, kv)

    def forward(self, batch: InputBatch, cache: PagedKVCache, backend: AttentionBackend) -> torch.Tensor:
        cfg, w = self.config, self.weights
        meta = batch.attention
        backend.prepare(meta)
        num_tokens = batch.num_tokens
        cos = self.cos.index_select(0, batch.positions)
        sin = self.sin.index_select(0, batch.positions)
        x = F.embedding(batch.input_ids, w.embed_tokens)
        for index, layer in enumerate(w.layers):
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(h)
            q, k, v = qkv.split(self._split, dim=-1)
            q = apply_rope(q.view(num_tokens, cfg.num_heads, cfg.head_dim), cos, sin)
            k = apply_rope(k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            k_cache, v_cache = cache.layer(index)
            backend.store_kv(k, v, k_cache, v_cache, meta)
            attn = backend.forward(q, k_cache, v_cache, meta)
            x = x + layer.o_proj(attn.reshape(num_tokens, -1))
            h = rms_norm(x, layer.post_attention_norm, cfg.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        x = x.index_select(0, batch.sample_indices)
        x = rms_norm(x, w.final_norm, cfg.rms_norm_eps)
        return w.lm_head(x).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back before the weight (as transformers does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; `x` [T, heads, head_dim], `cos`/`sin` [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
