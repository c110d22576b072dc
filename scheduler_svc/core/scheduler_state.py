"""The scheduler's state, and the read-only ways to look at it.

`SchedulerState` holds what every part of the scheduler shares (queues, requests, the
KV manager, step ids) and its introspection: `view()`, `stats()`, `check_invariants()`,
`debug_dump()`. Those only read, so `invariants` and tests depend on this surface,
not on the private containers that `StepBuilder` and `Scheduler` mutate on the hot path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

from scheduler_svc.core import invariants
from scheduler_svc.core.kv_manager import KvManager
from scheduler_svc.core.outputs import SchedulerStats
from scheduler_svc.core.request import Request, Sequence
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.scheduler_view import SchedulerView


@dataclass(slots=True)
class InFlight:
    """The plan the executor is running: what `update()` must advance when its result comes."""

    step_id: int
    scheduled: list[tuple[Sequence, int, bool]]
    """(sequence, tokens scheduled, whether it samples) for every scheduled sequence."""


class SchedulerState:
    """Every request, the queues and the KV manager, plus read-only introspection over them."""

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._bs = config.block_size
        self._eos = frozenset(config.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self._swapped: list[Sequence] = []
        self._pending_drops: list[int] = []
        self._inflight: InFlight | None = None
        self._next_seq_id = 0
        self._next_order = 0
        self._step_id = 0
        self._num_steps = 0
        self._num_preemptions = 0
        self._kv = KvManager(config.num_blocks, config.block_size, config.num_cpu_blocks, config.enable_prefix_caching)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def view(self) -> SchedulerView:
        """A snapshot of the queues and requests, with the live pool and tree (O(sequences + requests))."""
        kv = self._kv
        return SchedulerView(
            step_id=self._step_id,
            inflight_step_id=self._inflight.step_id if self._inflight else None,
            block_size=self._bs,
            max_num_seqs=self.config.max_num_seqs,
            config=self.config,
            waiting=tuple(self._waiting),
            running=tuple(self._running),
            swapped=tuple(self._swapped),
            requests=MappingProxyType(dict(self._requests)),
            pool=kv.pool,
            tree=kv.tree,
            cpu=kv.cpu,
            pinned=kv.pinned,
            pending_drops=tuple(self._pending_drops),
        )

    def stats(self) -> SchedulerStats:
        pool, cpu, tree = self._kv.pool, self._kv.cpu, self._kv.tree
        referenced = pool.num_referenced
        return SchedulerStats(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_swapped=len(self._swapped),
            num_blocks=pool.num_blocks,
            blocks_free=pool.num_free,
            blocks_cached=pool.num_cached,
            blocks_referenced=referenced,
            kv_usage=referenced / pool.num_blocks,
            prefix_queried_tokens=tree.queried_tokens,
            prefix_hit_tokens=tree.hit_tokens,
            num_preemptions=self._num_preemptions,
            num_cpu_blocks=cpu.num_blocks,
            cpu_blocks_used=cpu.num_blocks - cpu.num_free,
            num_steps=self._num_steps,
            num_requests=len(self._requests),
            blocks_reserved=pool.num_reserved,
        )

    def ref_count(self, block_id: int) -> int:
        """How many live block tables hold device block `block_id` (for tests and debugging)."""
        return self._kv.pool.ref_counts[block_id]

    def check_invariants(self) -> None:
        """Raise InvariantError (an AssertionError) naming the first broken KV/queue invariant."""
        invariants.check(self.view())

    def debug_dump(self) -> str:
        """Every live sequence's block table with ref counts, plus pool and tree summaries."""
        return invariants.dump(self.view())
