"""The tiers below the pool as an executor runs them (`kvserve.executor.kv_tier.plan_blocks.BlockTiers`):
host memory over disk, stores into both, loads from host memory first, the keys a tier lets go of,
and loads that run beside the caller's compute. No server: device blocks are a dict of bytes here.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvserve.executor.kv_tier.disk_store import DiskBlockStore
from kvserve.executor.kv_tier.host_store import HostBlockStore
from kvserve.executor.kv_tier.plan_blocks import BlockTiers, TierOps, run_tier_ops, start_tier_ops
from kvserve.protos.step import PlanError, StepPlan

FP = "test|block=64"
SIZE = 64
WAIT_S = 60.0


class Blocks:
    """Device blocks as bytes; `gate`, when set, holds every load until it opens."""

    def __init__(self) -> None:
        self.data: dict[int, bytes] = {}
        self.gate: threading.Event | None = None
        self.loading = threading.Event()

    def block_bytes(self, block: int) -> bytes:
        return self.data[block]

    def load_block(self, block: int, payload: bytes) -> bool:
        self.loading.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        self.data[block] = payload
        return True


def content(key: int) -> bytes:
    return bytes([key % 251]) * SIZE


def stored(blocks: Blocks, tiers: BlockTiers, keys: list[int]) -> TierOps:
    """Device blocks 0.. hold each key's content, stored into the tiers by one plan."""
    for block, key in enumerate(keys):
        blocks.data[block] = content(key)
    return run_tier_ops(StepPlan(step_id=1, store_blocks=list(enumerate(keys))), tiers, blocks)


def test_host_memory_serves_first_and_the_disk_what_it_let_go_of(tmp_path: Path) -> None:
    blocks = Blocks()
    disk = DiskBlockStore(tmp_path, 1 << 20, FP)
    tiers = BlockTiers(HostBlockStore(2 * SIZE), disk)
    assert tiers.media() == ["CPU", "DISK"]
    stored(blocks, tiers, [11, 12, 13])  # host memory keeps 12 and 13; the disk all three
    disk.flush()
    plan = StepPlan(step_id=2, load_blocks=[(20, 13), (21, 11), (22, 99)])
    ops = run_tier_ops(plan, tiers, blocks)
    assert ops.failed == [22], "no tier holds key 99"
    assert ops.from_disk == [21], "13 came from host memory, 11 from the disk"
    assert (blocks.data[20], blocks.data[21]) == (content(13), content(11))
    assert ops.dropped == [], "what host memory let go of is on disk: not dropped"
    assert 11 in tiers.host and 12 not in tiers.host, "11 is held in memory again, pushing out 12"
    tiers.close()


def test_host_memory_alone_reports_what_it_lets_go_of() -> None:
    blocks = Blocks()
    tiers = BlockTiers(HostBlockStore(2 * SIZE), None)
    assert tiers.media() == ["CPU"] and tiers.keys() == []
    ops = stored(blocks, tiers, [1, 2, 3])
    assert ops.dropped == [1], "the least recently used went, and nothing below holds it"
    assert run_tier_ops(StepPlan(step_id=2, load_blocks=[(5, 1)]), tiers, blocks).failed == [5]


def test_loads_run_beside_the_caller_and_their_result_waits_for_them() -> None:
    blocks = Blocks()
    tiers = BlockTiers(HostBlockStore(4 * SIZE), None)
    stored(blocks, tiers, [7])
    blocks.gate = threading.Event()
    finish = start_tier_ops(StepPlan(step_id=2, load_blocks=[(9, 7)]), tiers, blocks)
    assert blocks.loading.wait(WAIT_S), "the load started"
    assert 9 not in blocks.data, "start returned while the load still waits: it runs beside the caller"
    blocks.gate.set()
    ops = finish()
    assert ops.failed == [] and blocks.data[9] == content(7)
    tiers.close()


def test_tier_ops_without_a_tier_are_refused() -> None:
    with pytest.raises(PlanError, match="no tier below its pool"):
        run_tier_ops(StepPlan(step_id=3, load_blocks=[(1, 2)]), None, Blocks())
