"""Our own Llama-family forward pass over a flattened, unpadded batch.

Covers Llama, Mistral, Qwen2 (qkv bias) and SmolLM2: RMSNorm, rotary embeddings with
the config's theta and scaling, grouped-query attention through a pluggable paged
attention backend, SwiGLU MLP, tied or untied lm_head. Numerics follow transformers'
reference (RMSNorm in float32, rotate-half RoPE) so greedy tokens match it exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvserve.executor.attention.base import AttentionBackend
from kvserve.executor.lora.step_deltas import KernelLoraStep, LoraStep
from kvserve.executor.model.input_batch import InputBatch
from kvserve.executor.model.kv_cache import PagedKVCache
from kvserve.executor.model.native_layers import NativeLayers
from kvserve.executor.model_config import ModelConfig, RopeConfig
from kvserve.executor.weights.loader import ModelWeights

if TYPE_CHECKING:
    from kvserve.executor.tensor_parallel.group import TensorParallelGroup


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
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class LlamaModel:
    """Weights + rotary tables; `forward` runs one packed batch and returns sampled-row logits.

    Under tensor parallelism `config` is this rank's shard (its heads and MLP width,
    `TensorParallelLayout.shard_config`) and `group` completes the row-parallel products, the
    vocab-parallel embedding and the lm_head logits (`kvserve.executor.tensor_parallel.layout`)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        max_model_len: int,
        device: str,
        dtype: torch.dtype,
        group: TensorParallelGroup | None = None,
        silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None,
        norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None,
    ) -> None:
        """`silu_mul`: SwiGLU's activation of the fused gate/up product (default: torch's silu and mul).
        `norm`: RMSNorm (default `rms_norm`; compiled graphs take `opaque_norm.opaque_rms_norm`)."""
        self.config = config
        self.silu_mul = silu_mul or torch_silu_mul
        self.norm = norm or rms_norm
        self.weights = weights
        self.dtype = dtype
        self.group = group
        inv_freq = rope_inverse_frequencies(config.rope, config.head_dim)
        angles = torch.outer(torch.arange(max_model_len, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(device=device, dtype=dtype)
        half = config.head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * sin_signed: the sign lives in the table, not in a negation per layer.
        self.sin_signed = torch.cat([-angles[:, :half].sin(), angles[:, half:].sin()], dim=-1).to(
            device=device, dtype=dtype
        )
        self.scale = config.head_dim**-0.5
        self._qk_width = (config.num_heads + config.num_kv_heads) * config.head_dim
        self.native_layers = (
            NativeLayers.from_weights(config, weights)
            if group is None and device == "cpu" and dtype == torch.float32
            else None
        )
        """Native Q4_1 layers on one rank run as one C++ op each (`native_layers`), at every batch size."""

    def forward(
        self, batch: InputBatch, cache: PagedKVCache, backend: AttentionBackend, lora: LoraStep | None = None
    ) -> torch.Tensor | None:
        """Logits [sampled rows, vocab] in float32; None on a tensor-parallel rank other than 0.
        `lora`: the step's LoRA deltas, added to the products of the rows under an adapter."""
        cfg, w, group = self.config, self.weights, self.group
        meta = batch.attention
        backend.prepare(meta)
        x = w.embed(batch.input_ids)  # a fresh tensor: the residual adds below are in place
        if group is not None:
            group.all_reduce_(x)
        fused_lora = lora if isinstance(lora, KernelLoraStep) else None  # torch-op deltas run op by op
        if self.native_layers is not None and backend.name == "cpu" and (lora is None or fused_lora is not None):
            self.native_layers.run(x, batch.positions, (self.cos, self.sin_signed), cache, meta, fused_lora)
        else:
            self._layers(x, batch, cache, backend, lora)
        x = x.index_select(0, batch.sample_indices)
        x = self.norm(x, w.final_norm, cfg.rms_norm_eps)
        logits = w.lm_head(x).float()
        return logits if group is None else group.gather_columns(logits, cfg.vocab_size)

    def _layers(
        self,
        x: torch.Tensor,
        batch: InputBatch,
        cache: PagedKVCache,
        backend: AttentionBackend,
        lora: LoraStep | None = None,
    ) -> None:
        """Every decoder layer on `x` in place, op by op, with `lora`'s deltas added to its rows' products.

        Where the fused native layers exist, a step whose LoRA deltas are torch ops (`BmmLoraStep`) comes
        here with their kernels (`NativeLayers.norm`, `.silu_mul`): the fused op equals its steps run one
        by one, bit for bit, so a row gets the same bits whichever way its step ran."""
        cfg, w, group, meta = self.config, self.weights, self.group, batch.attention
        native = self.native_layers if backend.name == "cpu" else None  # the steps `forward` may fuse
        norm = native.norm if native is not None else self.norm
        silu_mul = native.silu_mul if native is not None else self.silu_mul
        num_tokens = batch.num_tokens
        cos = self.cos.index_select(0, batch.positions)[:, None, :]
        sin = self.sin_signed.index_select(0, batch.positions)[:, None, :]
        for index, layer in enumerate(w.layers):
            h = norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(h)
            if lora is not None:
                lora.add(index, "qkv", h, qkv)
            # q and k heads side by side, rotated in one pass.
            qk = apply_rope(qkv[:, : self._qk_width].view(num_tokens, -1, cfg.head_dim), cos, sin)
            q, k = qk[:, : cfg.num_heads].contiguous(), qk[:, cfg.num_heads :]
            v = qkv[:, self._qk_width :].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            k_cache, v_cache = cache.layer(index)
            backend.store_kv(k, v, k_cache, v_cache, meta)
            attn = backend.forward(q, k_cache, v_cache, meta)
            attn = attn.reshape(num_tokens, -1)
            attn_out = layer.o_proj(attn)
            if lora is not None:
                lora.add(index, "o_proj", attn, attn_out)
            x.add_(attn_out if group is None else group.all_reduce_(attn_out))
            h = norm(x, layer.post_attention_norm, cfg.rms_norm_eps)
            gate_up = layer.gate_up(h)
            if lora is not None:
                lora.add(index, "gate_up", h, gate_up)
            activated = silu_mul(gate_up)
            mlp_out = layer.down(activated)
            if lora is not None:
                lora.add(index, "down", activated, mlp_out)
            x.add_(mlp_out if group is None else group.all_reduce_(mlp_out))


def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused [tokens, 2 * intermediate] product, gate columns first."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back before the weight (as transformers does).

    The same operations in the same order as transformers, with in-place steps where they
    save an allocation; results are bit-identical."""
    xf = x.float()
    inv_rms = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (xf * inv_rms).to(x.dtype).mul_(weight)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; `x` [T, heads, head_dim], `cos`/`sin_signed` [T, 1, head_dim].

    `sin_signed` is sin with its first half negated, so `roll(x, half) * sin_signed` equals
    transformers' `rotate_half(x) * sin` bit for bit (a sign flip is exact)."""
    return (x * cos).add_(x.roll(x.shape[-1] // 2, dims=-1).mul_(sin_signed))
