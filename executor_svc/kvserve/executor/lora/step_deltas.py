"""One step's LoRA deltas: the rows under each adapter, and each targeted product's low-rank delta.

For the rows under an adapter, a fused product gets (x @ A.T) @ B.T × scaling added, as PEFT adds
it (`lora_B(lora_A(x)) * scaling`, then the base output plus that): the delta computed in float32
and added to the base product (also a quantized one: the native path's Q4_1 product) in float32,
rounded once to the product's dtype, as PEFT's float32 adapter weights promote the sum before it is
cast back. Rows under no adapter are never touched.

Two ways to compute it, chosen per step by `lora_step`:

- `KernelLoraStep`, on the CPU where kvserve's kernels are loaded: each product is one
  `kvserve.kernels.cpu_ops.lora_add` call for every adapter found in a slot, reading the slots'
  stacked tensors with each row's slot id, and one more call per adapter that runs from a step's own
  copy (past the slots). No gather, no scatter, no per-adapter ops: what cost a decode step 1.3x
  (batch 1) to 1.6x (batch 32) with eight adapters was ~35 µs of small ops per product.
- `BmmLoraStep` elsewhere (CUDA, or a CPU without the kernels, `--attention-backend torch
  --no-batch-invariant`): the rows gathered by adapter, two batched matmuls per adapter, scaled
  and scattered back.

Batch invariance (the CPU): the kernel sums each row in one fixed order of its own
(`kernels/cpu/lora_add.cpp`). On the torch path a GEMM library picks its kernel, and with it each
sum's order, by the number of rows in the call (`kvserve.executor.weights.row_invariance`), so each
row is its own item of one batched matmul (`torch.bmm`, batch = the rows, one row per item): every
item is the same [1, in] @ [in, width] product whatever the batch holds; the adapter's weights are
shared by every item (a stride-0 batch dimension), never copied per row. Either way a row's delta has
the same bits alone, among rows of its adapter, or beside other adapters
(tests/executor/test_lora_batches.py checks the rows of every width the forward pass meets, at
several batch sizes and thread counts).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.executor.lora.adapter import LoraAdapter, LoraMatrix
from kvserve.executor.lora.slots import LayerEntries, SlotStacks, SlottedAdapter
from kvserve.kernels import cpu_ops


class LoraStep(Protocol):
    """What `LlamaModel._layers` adds to a step's products: the deltas of the rows under adapters."""

    def add(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """`out` += the deltas of fused matrix `fused` of `layer` for the rows of input `x` under adapters."""


def rows_by_adapter(token_adapters: Sequence[int]) -> dict[int, list[int]]:
    """Each adapter index (>= 0) of `token_adapters` and the rows under it, in first-seen order."""
    groups: dict[int, list[int]] = {}
    for row, index in enumerate(token_adapters):
        if index >= 0:
            groups.setdefault(index, []).append(row)
    return groups


def lora_step(
    groups: dict[int, list[int]], adapters: dict[int, LoraAdapter], device: str, kernel: bool | None = None
) -> LoraStep:
    """The step of `groups` (adapter index -> rows, `rows_by_adapter`) with `adapters` on the device.
    `kernel`: whether the C++ kernel computes it (None: on the CPU where the kernels are loaded, the way
    the executor chose its other kernels; they are never compiled mid-step)."""
    if kernel is None:
        kernel = device == "cpu" and cpu_ops.is_loaded()
    return KernelLoraStep(groups, adapters) if kernel else BmmLoraStep.of(groups, adapters, device)


Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[int, ...]]
"""`cpu_ops.lora_add`'s a, b, ranks and columns for one product."""


class _SlotRows:
    """Rows whose adapters sit in the slots of `stacks`: one call per product reads them all."""

    def __init__(self, stacks: SlotStacks) -> None:
        self.stacks = stacks
        self.scaling = stacks.scaling
        self.slot_of_row: dict[int, int] = {}

    def operands(self, layer: int, fused: str) -> Operands | None:
        stacked = self.stacks.layers[layer].get(fused)
        return None if stacked is None else (stacked.a, stacked.b, stacked.ranks, stacked.columns)

    def layer_entries(self, layer: int) -> LayerEntries:
        """Built once per layer for the life of the slots: their tensors are updated in place."""
        cache = self.stacks.layer_entries
        if layer not in cache:
            cache[layer] = layer_entries(self.operands, layer)
        return cache[layer]


class _OwnRows:
    """Rows of one adapter that runs from tensors of its own (a step's copy past the slots, or an adapter
    made by hand): its matrices as a stack of one slot, in the slots' layout, so with the same bits.
    B is packed once per product and step: the cost of running past the slots."""

    def __init__(self, adapter: LoraAdapter) -> None:
        self.adapter = adapter
        self.scaling = torch.tensor([adapter.scaling], dtype=torch.float32)
        self.slot_of_row: dict[int, int] = {}

    def operands(self, layer: int, fused: str) -> Operands | None:
        matrix = self.adapter.layers[layer].get(fused)
        if matrix is None:
            return None
        a, b = matrix.a.unsqueeze(0), matrix.packed_b().unsqueeze(0)
        if matrix.ranks is None or matrix.columns is None:
            return a, b, None, ()
        return a, b, torch.tensor([matrix.ranks], dtype=torch.int32), matrix.columns

    def layer_entries(self, layer: int) -> LayerEntries:
        return layer_entries(self.operands, layer)


class KernelLoraStep:
    """A step's deltas on the CPU: per product one `cpu_ops.lora_add` call for the slots' rows, and one
    per adapter running from a copy of its own."""

    def __init__(self, groups: dict[int, list[int]], adapters: dict[int, LoraAdapter]) -> None:
        slotted: dict[int, _SlotRows] = {}
        self.sources: list[_SlotRows | _OwnRows] = []
        for index, rows in groups.items():
            adapter = adapters[index]
            source: _SlotRows | _OwnRows
            if isinstance(adapter, SlottedAdapter):
                key = id(adapter.stacks)
                if key not in slotted:
                    slotted[key] = _SlotRows(adapter.stacks)
                    self.sources.append(slotted[key])
                source, slot = slotted[key], adapter.slot
            else:
                source, slot = _OwnRows(adapter), 0
                self.sources.append(source)
            source.slot_of_row.update(dict.fromkeys(rows, slot))
        self._row_slots: list[torch.Tensor] = []
        """Per source, each row's slot there (-1: not its row), for the step's `x.shape[0]` rows."""
        self._scaling = [source.scaling for source in self.sources]

    def add(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> None:
        self.layer_lora(layer, x.shape[0]).add(fused, x, out)

    def layer_lora(self, layer: int, rows: int) -> cpu_ops.LayerLora:
        """Layer `layer`'s deltas over `rows` rows, as the fused decoder layer (`cpu_ops.decoder_layer`)
        takes them; `add` runs the same `lora_add` calls for a layer run op by op."""
        row_slots = self._slots_of_rows(rows)
        if len(self.sources) == 1:  # the common step: every adapter in the slots
            return cpu_ops.LayerLora(row_slots, self._scaling, *self.sources[0].layer_entries(layer))
        per_source = [source.layer_entries(layer) for source in self.sources]
        lists = [
            [entries[k][p] for p in range(len(cpu_ops.LayerLora.PRODUCTS)) for entries in per_source] for k in range(4)
        ]
        return cpu_ops.LayerLora(row_slots, self._scaling, *lists)

    def _slots_of_rows(self, rows: int) -> list[torch.Tensor]:
        if not self._row_slots or self._row_slots[0].shape[0] != rows:
            self._row_slots = [_slot_ids(source.slot_of_row, rows) for source in self.sources]
        return self._row_slots


_NONE = torch.empty(0)
"""An absent operand of `cpu_ops.LayerLora` (no matrix, or ranks None)."""


def layer_entries(operands: Callable[[int, str], Operands | None], layer: int) -> LayerEntries:
    """A source's operands for each product of `layer`, as `cpu_ops.LayerLora` lists them."""
    entries: LayerEntries = ([], [], [], [])
    for fused in cpu_ops.LayerLora.PRODUCTS:
        found = operands(layer, fused)
        if found is None:
            values = (_NONE, _NONE, _NONE, _NONE)
        else:
            a, b, ranks, columns = found
            values = (a, b, _NONE if ranks is None else ranks, _columns_tensor(tuple(columns)))
        for column, value in zip(entries, values, strict=True):
            column.append(value)
    return entries


@functools.cache
def _columns_tensor(columns: tuple[int, ...]) -> torch.Tensor:
    """A product's column boundaries as the int64 tensor `cpu_ops.LayerLora` takes (few distinct ones)."""
    return torch.tensor(columns, dtype=torch.int64)


def _slot_ids(slot_of_row: dict[int, int], rows: int) -> torch.Tensor:
    ids = [-1] * rows
    for row, slot in slot_of_row.items():
        ids[row] = slot
    return torch.tensor(ids, dtype=torch.int32)


def low_rank_product(x: torch.Tensor, matrix: LoraMatrix, out: torch.Tensor) -> None:
    """`out` [n, out] = (x @ a.T) @ b_t for float32 rows `x` [n, in], each row one item of a batched matmul."""
    rows = x.shape[0]
    shrunk = torch.bmm(x.unsqueeze(1), matrix.a.t().expand(rows, -1, -1))  # [rows, 1, width]
    torch.bmm(shrunk, matrix.b_t.expand(rows, -1, -1), out=out.unsqueeze(1))


@dataclass(frozen=True, slots=True)
class AdapterRows:
    """One adapter's rows: `BmmLoraStep.rows[start:end]`, and the adapter on the device."""

    start: int
    end: int
    adapter: LoraAdapter


class BmmLoraStep:
    """A step's deltas in torch ops, the rows under adapters grouped by adapter.

    Each product gathers those rows once (`rows`, adapter by adapter), computes each group's delta into
    its slice of one buffer, scales each row by its adapter's scaling and adds the buffer back in one
    scatter, so a step pays per adapter only the two batched matmuls. A group whose adapter does not
    target the product gets -0.0, which adds to any value exactly (x + -0.0 is x, also for x = -0.0)."""

    def __init__(self, rows: torch.Tensor, groups: list[AdapterRows], scales: torch.Tensor) -> None:
        self.rows = rows
        """[n] int64 on the device: every row under an adapter, grouped by adapter."""
        self.groups = groups
        self.scales = scales
        """[n, 1] float32: each of `rows`' adapter's scaling."""

    @classmethod
    def of(cls, groups: dict[int, list[int]], adapters: dict[int, LoraAdapter], device: str) -> BmmLoraStep:
        rows: list[int] = []
        spans = []
        scales: list[float] = []
        for index, members in groups.items():
            spans.append(AdapterRows(len(rows), len(rows) + len(members), adapters[index]))
            rows.extend(members)
            scales.extend([adapters[index].scaling] * len(members))
        return cls(
            torch.tensor(rows, dtype=torch.long, device=device),
            spans,
            torch.tensor(scales, dtype=torch.float32, device=device).unsqueeze(1),
        )

    def add(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> None:
        matrices = [group.adapter.layers[layer].get(fused) for group in self.groups]
        if all(matrix is None for matrix in matrices):
            return
        gathered = x.index_select(0, self.rows).float()
        delta = gathered.new_empty(gathered.shape[0], out.shape[1])
        for group, matrix in zip(self.groups, matrices, strict=True):
            if matrix is not None:
                low_rank_product(gathered[group.start : group.end], matrix, delta[group.start : group.end])
        delta.mul_(self.scales)
        for group, matrix in zip(self.groups, matrices, strict=True):
            if matrix is None:
                delta[group.start : group.end].fill_(-0.0)
        if out.dtype == torch.float32:
            out.index_add_(0, self.rows, delta)
        else:  # added in float32 and rounded once, as the kernel and PEFT do
            out.index_copy_(0, self.rows, out.index_select(0, self.rows).float().add_(delta).to(out.dtype))
