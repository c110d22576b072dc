"""The scheduler's state: one explicit object that the step builder and the result applier share.

`Scheduler` creates it and hands the same object to `StepBuilder` (which turns the queues into
a plan) and `ResultApplier` (which applies the executor's answer and ends sequences). Plain
attributes on a slotted dataclass, so the per-step hot path reads them at the cost of an
attribute load; nothing outside the core sees it (tests and invariants read `SchedulerView`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.scheduler.core.draft_proposer import DraftProposer
from kvserve.scheduler.core.kv_manager import KvManager
from kvserve.scheduler.core.request import Request, Sequence
from kvserve.scheduler.core.scheduler_config import SchedulerConfig


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence in a plan: how many of its tokens the step computes, and whether it samples."""

    seq: Sequence
    num_tokens: int
    samples: bool
    """The scheduled tokens reach the end of its known tokens, so the step returns its next token."""
    drafts: list[int] | None = None
    """Draft tokens the step verifies after its last known token (speculative decoding)."""
    masks: list[bytes] | None = None
    """Under a grammar, with drafts: the bitmask of each verified position (len(drafts) + 1 rows)."""


@dataclass(slots=True)
class InFlight:
    """The plan the executor is running: what the result applier must advance when its result comes."""

    step_id: int
    scheduled: list[ScheduledSequence]
    num_drafts: int = 0
    """Draft tokens in the plan: with any, a sequence may get several tokens back."""


@dataclass(slots=True)
class SchedulerState:
    """Every request, the queues, the KV manager and the step counters."""

    config: SchedulerConfig
    clock: Callable[[], float]
    kv: KvManager
    eos: frozenset[int]
    requests: dict[str, Request] = field(default_factory=dict)
    """Unfinished requests by id."""
    waiting: list[Sequence] = field(default_factory=list)
    """Waiting and recompute-preempted sequences, in `QUEUE_ORDER`."""
    running: list[Sequence] = field(default_factory=list)
    swapped: list[Sequence] = field(default_factory=list)
    pending_drops: list[int] = field(default_factory=list)
    """Sequence ids the next plan tells the executor to drop."""
    pending_trims: list[tuple[int, int]] = field(default_factory=list)
    """(seq_id, num_blocks) block-table cuts the next plan sends (rejected drafts' blocks)."""
    inflight: InFlight | None = None
    next_seq_id: int = 0
    next_order: int = 0
    """Arrival order of requests, the FCFS tie-break within a priority."""
    step_id: int = 0
    """Id of the last plan built."""
    num_steps: int = 0
    """Results applied."""
    num_preemptions: int = 0
    num_swap_outs: int = 0
    """Preemptions that swapped the sequence's KV to CPU (the rest recompute)."""
    proposer: DraftProposer | None = None
    """Speculative decoding's draft source (None: off); with one, outputs carry their request's `DraftCounts`."""
    num_drafts_proposed: int = 0
    num_drafts_accepted: int = 0
    num_verify_steps: int = 0

    @classmethod
    def fresh(
        cls, config: SchedulerConfig, clock: Callable[[], float], proposer: DraftProposer | None = None
    ) -> SchedulerState:
        kv = KvManager(config.num_blocks, config.block_size, config.num_cpu_blocks, config.enable_prefix_caching)
        return cls(config=config, clock=clock, kv=kv, eos=frozenset(config.eos_token_ids), proposer=proposer)

    @property
    def block_size(self) -> int:
        return self.config.block_size
