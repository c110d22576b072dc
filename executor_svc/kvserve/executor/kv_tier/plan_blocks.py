"""A plan's disk-tier block ops, the same for every executor: its stores, then its loads.

Why one function: the order is the contract (`StepPlan.store_blocks`: stores first, the plan may
reuse those blocks; then loads, a failed one listed in `StepResult.failed_load_blocks`), and the
real executor (K/V bytes of the paged cache) and the fake one (token slots) differ only in how a
block becomes bytes and back (`BlockBytes`).
"""

from __future__ import annotations

from typing import Protocol

from kvserve.executor.kv_tier.disk_store import DiskBlockStore
from kvserve.protos.step import PlanError, StepPlan


class BlockBytes(Protocol):
    """A device block as the disk tier stores it."""

    def block_bytes(self, block: int) -> bytes:
        """The block's contents."""
        ...

    def load_block(self, block: int, payload: bytes) -> bool:
        """Fill the block from `block_bytes`' payload; False (nothing written) when it does not fit."""
        ...


def run_disk_ops(plan: StepPlan, store: DiskBlockStore | None, blocks: BlockBytes) -> list[int]:
    """The plan's stores, then its loads; the blocks whose load failed (a missing or bad file, which the
    store counts and logs). PlanError when the plan has disk ops and the executor no disk tier."""
    if not (plan.store_blocks or plan.load_blocks):
        return []
    if store is None:
        raise PlanError(f"step {plan.step_id}: disk-tier block ops, but this executor has no --kv-disk-dir")
    for block, key in plan.store_blocks:
        store.put(key, blocks.block_bytes(block))
    failed = []
    for block, key in plan.load_blocks:
        payload = store.get(key)
        if payload is None or not blocks.load_block(block, payload):
            failed.append(block)
    return failed
