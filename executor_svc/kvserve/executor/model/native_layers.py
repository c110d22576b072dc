"""The native path's decoder layers, each one C++ op (`kvserve.kernels.cpu_ops.decoder_layer`).

Why: at batch 1 a layer's arithmetic is a few hundred microseconds, and the ~100 torch ops the
Python forward dispatched for it (norms, rotary, views, residual adds) cost about as much again;
the fused op runs the same kernels with no Python between them. It serves every batch size of
the configuration that has it, so a token's bits never depend on whether its step was fused.

Used where every layer's matrices are Q4_1 codes without biases, on one rank, with float32
activations and the CPU attention kernels (their head-major cache): `--weights native`'s own
configuration. Its RMSNorm is the kernels' (`cpu_ops.rms_norm`), one fixed order per row. A step
with rows under LoRA adapters runs here too: each layer adds their deltas after its products
(`KernelLoraStep.layer_lora`), so adapters keep the fused layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.executor.attention.base import AttentionMetadata
from kvserve.executor.lora.step_deltas import KernelLoraStep
from kvserve.executor.model.kv_cache import PagedKVCache
from kvserve.executor.model_config import ModelConfig
from kvserve.executor.weights.loader import Matrix, ModelWeights
from kvserve.executor.weights.q4_1_linear import Q4_1Linear
from kvserve.executor.weights.row_invariance import RowFixedLinear
from kvserve.kernels import cpu_ops


@dataclass(frozen=True, slots=True)
class _LayerArgs:
    norms: tuple[torch.Tensor, torch.Tensor]
    matrices: tuple[list[torch.Tensor], list[torch.Tensor], list[int]]


class NativeLayers:
    """Every layer's fused op over one packed batch; built once from the loaded weights."""

    norm = staticmethod(cpu_ops.rms_norm)
    """The fused op's RMSNorm, for the op-by-op layers of a step it does not run (LoRA deltas in torch
    ops, `BmmLoraStep`): with it (and `silu_mul`) those layers give a row the fused op's bits
    (tests/kernels/test_decoder_layer.py)."""
    silu_mul = staticmethod(cpu_ops.silu_mul)
    """The fused op's SwiGLU activation."""

    def __init__(self, config: ModelConfig, layers: list[_LayerArgs]) -> None:
        self.config = config
        self._layers = layers

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: ModelWeights) -> NativeLayers | None:
        """The fused layers, or None where a layer's matrices are not all bias-free Q4_1 codes."""
        layers = []
        for layer in weights.layers:
            found = [_q4_1(m) for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            q4 = [m for m in found if m is not None and m.bias is None]
            if len(q4) < len(found):
                return None
            norms = (layer.input_norm, layer.post_attention_norm)
            if any(n.dtype != torch.float32 or n.device.type != "cpu" for n in norms):
                return None
            layers.append(
                _LayerArgs(
                    norms=norms,
                    matrices=([m.codes for m in q4], [m.scales for m in q4], [m.out_features for m in q4]),
                )
            )
        return cls(config, layers)

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        cache: PagedKVCache,
        meta: AttentionMetadata,
        lora: KernelLoraStep | None = None,
    ) -> None:
        """Every layer on `x` [tokens, hidden] in place; `rotary` is the model's (cos, sin_signed) tables;
        `lora`: the step's deltas for its rows under adapters, added inside each fused layer."""
        cfg = self.config
        heads = (cfg.num_heads, cfg.num_kv_heads)
        tables = (positions, rotary[0], rotary[1])
        attention = (meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.scale)
        for index, layer in enumerate(self._layers):
            deltas = None if lora is None else lora.layer_lora(index, x.shape[0])
            cpu_ops.decoder_layer(
                x, layer.norms, cfg.rms_norm_eps, layer.matrices, tables, heads, cache.layer(index), attention, deltas
            )


def _q4_1(matrix: Matrix) -> Q4_1Linear | None:
    """The Q4_1 kernel a layer matrix calls at every row count, or None where it is another kernel or
    one called in fixed shapes (padded or split: the fused op calls it once with every row)."""
    if isinstance(matrix, RowFixedLinear):
        called_whole = matrix.min_rows == 1 and matrix.max_rows is None
        return matrix.inner if called_whole and isinstance(matrix.inner, Q4_1Linear) else None
    return matrix if isinstance(matrix, Q4_1Linear) else None
