"""The tiers below the pool as an executor runs them: a plan's stores, then its loads.

Why one module: the order is the contract (`StepPlan.store_blocks`: stores first, the plan may
reuse those blocks; then loads, a failed one listed in `StepResult.failed_load_blocks`), and the
real executor (K/V bytes of the paged cache) and the fake one (token slots) differ only in how a
block becomes bytes and back (`BlockBytes`).

The tiers: host memory (`--kv-host-gb`) over disk (`--kv-disk-dir`), either or both. A store goes
to both (write-through: the disk keeps what host memory lets go of, across restarts too); a load
reads host memory first, then the disk, and a block read from the disk is held in host memory
again. Keys no tier holds any more go back to the scheduler (`StepResult.dropped_keys`).

Loads may overlap the step's compute (`start_tier_ops`): a loaded block is a fresh one that nothing
in its step reads or writes (its request waits for the step's result), so one thread fills it while
the forward pass runs, and the result waits for both. File reads, checksums and tensor copies
release the GIL.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvserve.executor.kv_tier.disk_store import DiskBlockStore
from kvserve.executor.kv_tier.host_store import HostBlockStore
from kvserve.protos.kv_events import MEDIUM_CPU, MEDIUM_DISK
from kvserve.protos.kv_geometry import GIB
from kvserve.protos.step import PlanError, StepPlan


class BlockBytes(Protocol):
    """A device block as the tiers store it."""

    def block_bytes(self, block: int) -> bytes:
        """The block's contents."""
        ...

    def load_block(self, block: int, payload: bytes) -> bool:
        """Fill the block from `block_bytes`' payload; False (nothing written) when it does not fit."""
        ...


@dataclass(slots=True)
class TierOps:
    """What a plan's tier ops did, for its `StepResult`."""

    failed: list[int] = field(default_factory=list)
    """Blocks whose load failed (a missing or bad block, which the store counts and logs)."""
    from_disk: list[int] = field(default_factory=list)
    """Blocks loaded from the disk; the others loaded came from host memory."""
    dropped: list[int] = field(default_factory=list)
    """Keys no tier holds any more."""


class BlockTiers:
    """An executor's tiers below the pool: `host`, `disk`, or both."""

    def __init__(self, host: HostBlockStore | None, disk: DiskBlockStore | None) -> None:
        if host is None and disk is None:
            raise ValueError("BlockTiers needs a host-memory tier, a disk tier or both")
        self.host = host
        self.disk = disk
        self._loader: ThreadPoolExecutor | None = None

    @staticmethod
    def asked_for(host_gb: float, disk_dir: str | None) -> bool:
        """Whether `--kv-host-gb` or `--kv-disk-dir` asks for a tier below the pool."""
        return host_gb > 0 or disk_dir is not None

    @classmethod
    def open(
        cls, host_gb: float, disk_dir: str | None, disk_gb: float, fingerprint: str, *, queue_blocks: int = 256
    ) -> BlockTiers:
        """The tiers `--kv-host-gb`, `--kv-disk-dir` and `--kv-disk-gb` ask for (`asked_for` first), the
        disk's blocks checked against `fingerprint`, what the cache's bits depend on (`DiskBlockStore`)."""
        host = HostBlockStore(int(host_gb * GIB)) if host_gb > 0 else None
        disk = None
        if disk_dir is not None:
            disk = DiskBlockStore(Path(disk_dir), int(disk_gb * GIB), fingerprint, queue_blocks=queue_blocks)
        return cls(host, disk)

    def media(self) -> list[str]:
        """The tiers, by vLLM's KV-event medium names, fastest first."""
        return [medium for medium, tier in ((MEDIUM_CPU, self.host), (MEDIUM_DISK, self.disk)) if tier is not None]

    def close(self) -> None:
        """Let the disk's queued writes finish (host memory dies with the process)."""
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()

    def keys(self) -> list[int]:
        """The keys held at start (the handshake's `kv_disk_keys`): host memory starts empty."""
        return self.disk.keys() if self.disk is not None else []

    def start(self, plan: StepPlan, blocks: BlockBytes) -> Callable[[], TierOps]:
        """The plan's stores now, its loads on the loader thread; call the result to wait for them."""
        self.store(plan, blocks)
        if not plan.load_blocks:
            return lambda: self.load(plan, blocks)
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-loads")
        return self._loader.submit(self.load, plan, blocks).result

    def store(self, plan: StepPlan, blocks: BlockBytes) -> None:
        """The plan's stores, into every tier."""
        host, disk = self.host, self.disk
        for block, key in plan.store_blocks:
            payload = blocks.block_bytes(block)
            if host is not None:
                host.put(key, payload)
            if disk is not None:
                disk.put(key, payload)

    def load(self, plan: StepPlan, blocks: BlockBytes) -> TierOps:
        """The plan's loads, host memory first; and the keys let go of since the last plan."""
        ops = TierOps()
        host, disk = self.host, self.disk
        for block, key in plan.load_blocks:
            loaded = host.get(key) if host is not None else None
            from_disk = loaded is None and disk is not None
            if from_disk:
                assert disk is not None
                loaded = disk.get(key)
                if loaded is not None and host is not None:
                    host.put(key, loaded)
            if loaded is None or not blocks.load_block(block, loaded):
                ops.failed.append(block)
            elif from_disk:
                ops.from_disk.append(block)
        ops.dropped = self.take_dropped()
        return ops

    def take_dropped(self) -> list[int]:
        host, disk = self.host, self.disk
        dropped = host.take_dropped() if host is not None else []
        if disk is not None:
            dropped = [key for key in dropped if not disk.holds(key)]
            dropped += [key for key in disk.take_evicted() if host is None or key not in host]
        return dropped


def run_tier_ops(plan: StepPlan, tiers: BlockTiers | None, blocks: BlockBytes) -> TierOps:
    """The plan's tier ops; PlanError when it has some and the executor has no tier."""
    return start_tier_ops(plan, tiers, blocks)()


def start_tier_ops(plan: StepPlan, tiers: BlockTiers | None, blocks: BlockBytes) -> Callable[[], TierOps]:
    """The plan's stores now and its loads beside the caller's compute (`BlockTiers.start`); call the result
    for what they did. PlanError when the plan has tier ops and the executor no tier."""
    if not (plan.store_blocks or plan.load_blocks):
        return lambda: TierOps(dropped=tiers.take_dropped() if tiers is not None else [])
    if tiers is None:
        raise PlanError(f"step {plan.step_id}: KV tier block ops, but this executor has no tier below its pool")
    return tiers.start(plan, blocks)
