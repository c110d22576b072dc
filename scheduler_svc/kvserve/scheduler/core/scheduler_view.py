"""The scheduler's read-only surface: a `SchedulerView` snapshot for invariants, dumps and tests, and its stats.

A module of its own so that `invariants` (which reads views) and the scheduler (which builds
them) do not import each other. Nothing on the per-step hot path builds a view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvserve.scheduler.core.block_pool import BlockPool, CpuBlockPool
from kvserve.scheduler.core.outputs import DiskTierStats, SchedulerStats
from kvserve.scheduler.core.prefix_tree import PrefixTree
from kvserve.scheduler.core.request import Request, Sequence
from kvserve.scheduler.core.scheduler_config import SchedulerConfig
from kvserve.scheduler.core.scheduler_state import SchedulerState


@dataclass(frozen=True, slots=True)
class SchedulerView:
    """A read-only look at the scheduler for invariants, dumps and tests; built on request, never per step.

    Queues, requests and id lists are copies taken by `view_of()`. `pool`, `tree` and `cpu`
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
    inflight_drafts: Mapping[int, int]
    """Draft tokens the plan in flight verifies, by sequence id (speculative decoding): their slots
    are allocated until the result rolls back the rejected ones."""
    loading: tuple[int, ...] = ()
    """Blocks the disk tier's loads in flight reference: the chains they extend and the blocks loading."""
    disk: DiskTierStats | None = None
    """The prefix cache's disk tier, when the executor has one."""


def view_of(state: SchedulerState) -> SchedulerView:
    """A snapshot of the queues and requests, with the live pool and tree (O(sequences + requests))."""
    kv = state.kv
    return SchedulerView(
        step_id=state.step_id,
        inflight_step_id=state.inflight.step_id if state.inflight else None,
        block_size=state.block_size,
        max_num_seqs=state.config.max_num_seqs,
        config=state.config,
        waiting=tuple(state.waiting),
        running=tuple(state.running),
        swapped=tuple(state.swapped),
        requests=MappingProxyType(dict(state.requests)),
        pool=kv.pool,
        tree=kv.tree,
        cpu=kv.cpu,
        pinned=kv.pinned,
        loading=kv.disk.referenced_blocks() if kv.disk is not None else (),
        disk=kv.disk.stats() if kv.disk is not None else None,
        pending_drops=tuple(state.pending_drops),
        inflight_drafts=MappingProxyType(
            {s.seq.seq_id: len(s.drafts) for s in state.inflight.scheduled if s.drafts}
            if state.inflight is not None and state.inflight.num_drafts
            else {}
        ),
    )


def stats_of(state: SchedulerState) -> SchedulerStats:
    pool, cpu, tree = state.kv.pool, state.kv.cpu, state.kv.tree
    referenced = pool.num_referenced
    return SchedulerStats(
        num_waiting=len(state.waiting),
        num_running=len(state.running),
        num_swapped=len(state.swapped),
        num_blocks=pool.num_blocks,
        blocks_free=pool.num_free,
        blocks_cached=pool.num_cached,
        blocks_referenced=referenced,
        kv_usage=referenced / pool.num_blocks,
        prefix_queried_tokens=tree.queried_tokens,
        prefix_hit_tokens=tree.hit_tokens,
        num_preemptions=state.num_preemptions,
        num_swap_outs=state.num_swap_outs,
        num_evicted_blocks=pool.num_evicted_total,
        num_cpu_blocks=cpu.num_blocks,
        cpu_blocks_used=cpu.num_blocks - cpu.num_free,
        num_steps=state.num_steps,
        num_requests=len(state.requests),
        blocks_reserved=pool.num_reserved,
        draft_tokens_proposed=state.num_drafts_proposed,
        draft_tokens_accepted=state.num_drafts_accepted,
        draft_verify_steps=state.num_verify_steps,
        disk=state.kv.disk.stats() if state.kv.disk is not None else None,
    )
