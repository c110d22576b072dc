"""`SchedulerView`: the scheduler's public read-only surface, for invariants, dumps and tests.

A module of its own so that `invariants` (which reads it) and `scheduler_state` (which
builds it) do not import each other. Nothing on the per-step hot path builds a view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from scheduler_svc.core.block_pool import BlockPool, CpuBlockPool
from scheduler_svc.core.prefix_tree import PrefixTree
from scheduler_svc.core.request import Request, Sequence
from scheduler_svc.core.scheduler_config import SchedulerConfig


@dataclass(frozen=True, slots=True)
class SchedulerView:
    """A read-only look at the scheduler for invariants, dumps and tests; built on request, never per step.

    Queues, requests and id lists are copies taken by `view()`. `pool`, `tree` and `cpu`
    are the live objects (too big to copy): read them, never change them.
    """

    step_id: int
    """Id of the last plan built (0 before the first)."""
    inflight_step_id: int | None
    """Id of the plan awaiting its `update()`, or None."""
    block_size: int
    max_num_seqs: int
    config: SchedulerConfig
    """The live config (policies such as `kv_reservation`): read it, never change it."""
    waiting: tuple[Sequence, ...]
    """Waiting and recompute-preempted sequences, in priority order."""
    running: tuple[Sequence, ...]
    swapped: tuple[Sequence, ...]
    requests: Mapping[str, Request]
    """Unfinished requests by id."""
    pool: BlockPool
    tree: PrefixTree
    cpu: CpuBlockPool
    pinned: tuple[int, ...]
    """Copy sources held until the plan being built is complete (empty between steps)."""
    pending_drops: tuple[int, ...]
    """Sequence ids the next plan tells the executor to drop."""
