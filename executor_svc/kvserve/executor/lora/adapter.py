"""An adapter in the forward pass's layout: one low-rank pair per fused matrix of each layer.

The forward pass runs q/k/v as one `qkv` product and gate/up as one `gate_up` product
(`kvserve.executor.weights.loader`). An adapter's pairs are packed the same way, so each fused
matrix costs one delta whichever of its projections the adapter targets: the targets' A matrices
stacked ([sum of ranks, in]), and their B matrices transposed into the rows of one block-diagonal
[sum of ranks, out] matrix whose columns are the fused output's. A projection the adapter does not
target gets no rows, and the columns of its neighbour get exact zeros, which leave the base
product's bits as they are. Each matrix also records its projections' ranks and columns: the CPU
kernel (`kvserve.kernels.cpu_ops.lora_add`) multiplies each projection's rows by its own columns only,
from B packed without the zero blocks (`LoraMatrix.packed_b`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvserve.executor.model_config import ModelConfig

FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
"""Each fused matrix of a layer (`LayerWeights`' names) and the projections it holds, column order."""


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection a LoRA pair may target: A is [r, in], B is [out, r]."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


@dataclass(frozen=True, slots=True)
class LoraMatrix:
    """One fused matrix's pair: the delta of rows `x` is (x @ a.T) @ b_t, times the adapter's scaling."""

    a: torch.Tensor
    """[width, in]: the targets' A matrices stacked, float32."""
    b_t: torch.Tensor
    """[width, out]: their B matrices transposed, block-diagonal over the fused output's columns, float32."""
    ranks: tuple[int, ...] | None = None
    """The rows of each projection of the fused matrix (`FUSED` order, 0: not targeted), as stacked; with
    `columns`, where b_t's blocks lie, so the CPU kernel reads only them. None: one block of every row
    and every column (a matrix made by hand, for a test)."""
    columns: tuple[int, ...] | None = None
    """The fused output's column boundaries, one more than `ranks` (projection p: [columns[p], columns[p + 1]))."""

    @property
    def width(self) -> int:
        return self.a.shape[0]

    def packed_b(self, by_projection: bool = True) -> torch.Tensor:
        """B as the CPU kernel reads it (`kvserve.kernels.cpu_ops.lora_add`), flat: with `by_projection`
        (and a projection layout), each projection's rows against its own columns only, row-major, one
        block after another, no zero block; else b_t whole."""
        if not by_projection or self.ranks is None or self.columns is None:
            return self.b_t.reshape(-1)
        blocks, first = [], 0
        for p, rank in enumerate(self.ranks):
            blocks.append(self.b_t[first : first + rank, self.columns[p] : self.columns[p + 1]].reshape(-1))
            first += rank
        return torch.cat(blocks)


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A loaded adapter: per layer, the fused matrices it targets (absent: no delta there)."""

    name: str
    rank: int
    scaling: float
    layers: list[dict[str, LoraMatrix]]

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b_t.nbytes for layer in self.layers for m in layer.values())

    def to(self, device: str | torch.device, pin: bool = False) -> LoraAdapter:
        """The same adapter on `device` (itself where it is there already); `pin`: in page-locked host
        memory, so a copy to a CUDA device can run without a staging copy. Always a plain `LoraAdapter`:
        a copy of a slot's adapter (`kvserve.executor.lora.slots.SlottedAdapter`) is in no slot."""
        layers = [
            {name: replace(m, a=_place(m.a, device, pin), b_t=_place(m.b_t, device, pin)) for name, m in layer.items()}
            for layer in self.layers
        ]
        return LoraAdapter(self.name, self.rank, self.scaling, layers)


def _place(tensor: torch.Tensor, device: str | torch.device, pin: bool) -> torch.Tensor:
    moved = tensor.to(device)
    return moved.pin_memory() if pin else moved


def pack_layer(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], config: ModelConfig) -> dict[str, LoraMatrix]:
    """One layer's (A [r, in], B [out, r]) pairs by projection, shapes checked, packed by fused matrix."""
    shapes = projection_shapes(config)
    packed = {}
    for fused, projections in FUSED.items():
        present = [p for p in projections if p in pairs]
        if not present:
            continue
        width = sum(pairs[p][0].shape[0] for p in present)
        out = sum(shapes[p][1] for p in projections)
        b_t = torch.zeros(width, out, dtype=torch.float32)
        row, column = 0, 0
        for projection in projections:
            columns = shapes[projection][1]
            if projection in pairs:
                b = pairs[projection][1]
                b_t[row : row + b.shape[1], column : column + columns] = b.t()
                row += b.shape[1]
            column += columns
        a = torch.cat([pairs[p][0] for p in present]).float().contiguous()
        ranks = tuple(pairs[p][0].shape[0] if p in pairs else 0 for p in projections)
        bounds = [0]
        for projection in projections:
            bounds.append(bounds[-1] + shapes[projection][1])
        packed[fused] = LoraMatrix(a, b_t, ranks, tuple(bounds))
    return packed
