"""A packed step's paged-attention metadata, for the CPU kernel tests that build steps by hand."""

from __future__ import annotations

import torch


def step_metadata(
    cached: list[int], new: list[int], tables: list[list[int]], block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions, slot mapping, block tables (padded with block 0), query starts and sequence lengths of
    a step whose sequence i has `cached[i]` tokens in the cache and `new[i]` scheduled, in the blocks of
    `tables[i]`."""
    positions, slots = [], []
    for before, count, table in zip(cached, new, tables, strict=True):
        for p in range(before, before + count):
            positions.append(p)
            slots.append(table[p // block] * block + p % block)
    width = max(len(t) for t in tables)
    return (
        torch.tensor(positions, dtype=torch.int64),
        torch.tensor(slots, dtype=torch.int64),
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32),
        torch.tensor([b + n for b, n in zip(cached, new, strict=True)], dtype=torch.int32),
    )
