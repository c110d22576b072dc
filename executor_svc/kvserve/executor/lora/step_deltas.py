"""One step's LoRA deltas: the rows under each adapter, and each targeted product's low-rank delta.

For the rows under an adapter, a fused product gets (x @ A.T) @ B.T × scaling added, as PEFT adds
it (`lora_B(lora_A(x)) * scaling`, then the base output plus that): the rows gathered by adapter,
the delta computed in float32 and added to the base product (also a quantized one: the native
path's Q4_1 product) in its dtype. Rows under no adapter are never touched.

Batch invariance: a GEMM library picks its kernel, and with it each sum's order, by the number of
rows in the call (`kvserve.executor.weights.row_invariance`), so an [n, in] @ [in, r] product would
give a row other bits alone than among n. Here each row is its own item of one batched matmul
(`torch.bmm`, batch = the rows, one row per item): every item is the same [1, in] @ [in, width]
product whatever the batch holds, so a row's delta has the same bits alone, among rows of its
adapter, or beside other adapters (tests/executor/test_lora_batches.py checks the rows of every
width the forward pass meets, at several batch sizes and thread counts). The adapter's weights are
shared by every item (a stride-0 batch dimension), never copied per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.executor.lora.adapter import LoraAdapter, LoraMatrix


def low_rank_product(x: torch.Tensor, matrix: LoraMatrix, out: torch.Tensor) -> None:
    """`out` [n, out] = (x @ a.T) @ b_t for float32 rows `x` [n, in], each row one item of a batched matmul."""
    rows = x.shape[0]
    shrunk = torch.bmm(x.unsqueeze(1), matrix.a.t().expand(rows, -1, -1))  # [rows, 1, width]
    torch.bmm(shrunk, matrix.b_t.expand(rows, -1, -1), out=out.unsqueeze(1))


@dataclass(frozen=True, slots=True)
class AdapterRows:
    """One adapter's rows: `LoraStep.rows[start:end]`, and the adapter on the device."""

    start: int
    end: int
    adapter: LoraAdapter


def rows_by_adapter(token_adapters: Sequence[int]) -> dict[int, list[int]]:
    """Each adapter index (>= 0) of `token_adapters` and the rows under it, in first-seen order."""
    groups: dict[int, list[int]] = {}
    for row, index in enumerate(token_adapters):
        if index >= 0:
            groups.setdefault(index, []).append(row)
    return groups


class LoraStep:
    """What `LlamaModel._layers` adds to a step's products: the rows under adapters, grouped by adapter.

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

    def add(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """`out` += the deltas of fused matrix `fused` of `layer` for the rows of input `x` under adapters."""
        matrices = [group.adapter.layers[layer].get(fused) for group in self.groups]
        if all(matrix is None for matrix in matrices):
            return
        gathered = x.index_select(0, self.rows).float()
        delta = gathered.new_empty(gathered.shape[0], out.shape[1])
        for group, matrix in zip(self.groups, matrices):
            if matrix is not None:
                low_rank_product(gathered[group.start : group.end], matrix, delta[group.start : group.end])
        delta.mul_(self.scales)
        for group, matrix in zip(self.groups, matrices):
            if matrix is None:
                delta[group.start : group.end].fill_(-0.0)
        out.index_add_(0, self.rows, delta.to(out.dtype))


def lora_step(groups: dict[int, list[int]], adapters: dict[int, LoraAdapter], device: str) -> LoraStep:
    """The step of `groups` (adapter index -> rows, `rows_by_adapter`) with `adapters` on the device."""
    rows: list[int] = []
    spans = []
    scales: list[float] = []
    for index, members in groups.items():
        spans.append(AdapterRows(len(rows), len(rows) + len(members), adapters[index]))
        rows.extend(members)
        scales.extend([adapters[index].scaling] * len(members))
    return LoraStep(
        torch.tensor(rows, dtype=torch.long, device=device),
        spans,
        torch.tensor(scales, dtype=torch.float32, device=device).unsqueeze(1),
    )
