"""Step building: turns the queues into one StepPlan per step (the per-step hot path).

Each step packs, within `max_num_batched_tokens` and `max_num_seqs`:

1. running sequences in priority order: decodes (one token) first, then the next chunk
   of any partly computed prompt; when a block is missing, the lowest-priority,
   latest-arrived running sequence is preempted (recompute, or swap to CPU);
2. swapped-out sequences, swapped back in, in priority order;
3. waiting sequences, admitted after a prefix-cache match (or a fork from completion 0
   for n > 1) if the pool can hold their whole known tokens.

Steps 2 and 3 are skipped in a step that had to preempt. Building a plan advances no
sequence: `Scheduler.update()` does that once the step is confirmed, so a plan lost with
its executor leaves nothing half-done. Per step the work is O(scheduled sequences); the
tree is touched only at admission and when a block fills. Kept apart from `Scheduler`
(request lifecycle and results) so the plan-building rules read in one place.
"""

from __future__ import annotations

import bisect

import structlog

from protos.step import KnownSequence, NewSequence, StepPlan
from scheduler_svc.core import admission
from scheduler_svc.core.request import QUEUE_ORDER, Sequence, SequenceStatus
from scheduler_svc.core.scheduler_state import InFlight, SchedulerState

log = structlog.get_logger(__name__)

_RUNNING = SequenceStatus.RUNNING


def _count_decodes(running: list[Sequence], start: int) -> int:
    count = 0
    for index in range(start, len(running)):
        seq = running[index]
        if len(seq.token_ids) - seq.num_computed == 1:
            count += 1
    return count


def _attach_masks(plan: StepPlan, scheduled: list[tuple[Sequence, int, bool]]) -> None:
    """The bitmask of every constrained sequence that samples this step (structured output).

    One pass over the scheduled list: an unconstrained batch pays one attribute test per
    sequence and sends no mask bytes.
    """
    rows = [(seq.seq_id, seq.matcher) for seq, _count, samples in scheduled if samples and seq.matcher is not None]
    if rows:
        plan.mask_seq_ids = [seq_id for seq_id, _ in rows]
        plan.token_masks = b"".join(matcher.next_token_bitmask() for _, matcher in rows)


class StepBuilder(SchedulerState):
    """`schedule()`: packs running, swapped and waiting sequences into one plan; preempts when blocks run out."""

    # --- one step --------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Build the next plan. An empty plan (`plan.is_empty`) needs no executor step or update()."""
        if self._inflight is not None:
            raise RuntimeError(f"step {self._inflight.step_id} is still in flight: call update() first")
        self._step_id += 1
        plan = StepPlan(step_id=self._step_id, drop_seq_ids=self._pending_drops)
        self._pending_drops = []
        scheduled: list[tuple[Sequence, int, bool]] = []
        budget, preempted = self._schedule_running(plan, scheduled)
        if not preempted:
            budget = self._schedule_swapped(plan, scheduled, budget)
            if not self._swapped:
                self._schedule_waiting(plan, scheduled, budget)
        self._kv.unpin()
        _attach_masks(plan, scheduled)
        if not plan.is_empty:
            self._inflight = InFlight(plan.step_id, scheduled)
        if self.config.debug_invariants:
            self.check_invariants()
        return plan

    def _schedule_running(self, plan: StepPlan, scheduled: list[tuple[Sequence, int, bool]]) -> tuple[int, bool]:
        running = self._running
        bs = self._bs
        budget = self.config.max_num_batched_tokens
        add_cached = plan.known_seqs.append
        add_scheduled = scheduled.append
        # Token budget is reserved for decodes first, so prefill chunks take only what is left.
        # Counted lazily: a pure-decode step never needs it.
        decodes_left: int | None = None
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed
            tokens = seq.token_ids
            num_tokens = len(tokens)
            if num_tokens - computed == 1:
                count = 1
                if decodes_left is not None:
                    decodes_left -= 1
            else:
                if decodes_left is None:
                    decodes_left = _count_decodes(running, i + 1)
                count = min(num_tokens - computed, budget - decodes_left)
                if count <= 0:
                    i += 1
                    continue
            table = seq.block_table
            if computed + count > len(table) * bs:
                preemptions_before = self._num_preemptions
                new_blocks = self._allocate_or_preempt(seq, (computed + count + bs - 1) // bs - len(table), plan)
                if self._num_preemptions != preemptions_before:
                    preempted = True
                    decodes_left = None  # victims may have been decodes: recount when needed
                if new_blocks is None:  # `seq` itself was preempted (it was last in `running`)
                    continue
                table.extend(new_blocks)
            budget -= count
            add_cached(KnownSequence(seq.seq_id, tokens[seq.sent_tokens :], computed, count, table[seq.sent_blocks :]))
            seq.sent_tokens = num_tokens
            seq.sent_blocks = len(table)
            add_scheduled((seq, count, computed + count == num_tokens))
            i += 1
        return budget, preempted

    def _allocate_or_preempt(self, seq: Sequence, need: int, plan: StepPlan) -> list[int] | None:
        """`need` blocks for `seq`, preempting from the tail of `running` until they fit (None: `seq` went)."""
        blocks = self._kv.allocate(seq, need)
        while blocks is None:
            victim = self._running[-1]
            self._preempt(victim, plan)
            if victim is seq:
                return None
            blocks = self._kv.allocate(seq, need)
        return blocks

    def _schedule_swapped(self, plan: StepPlan, scheduled: list[tuple[Sequence, int, bool]], budget: int) -> int:
        # Runs after every swap-out of this plan, so the CPU blocks it frees are not reused before they are read.
        while self._swapped and budget > 0 and len(self._running) < self.config.max_num_seqs:
            seq = self._swapped[0]
            count = min(len(seq.token_ids) - seq.num_computed, budget)
            if not self._kv.swap_in(seq, count, plan):
                break
            del self._swapped[0]
            self._start_running(seq, count, plan, scheduled)
            budget -= count
        return budget

    def _schedule_waiting(self, plan: StepPlan, scheduled: list[tuple[Sequence, int, bool]], budget: int) -> None:
        if not self._waiting:
            return
        cfg = self.config
        ranked = (
            admission.admission_order(self._waiting, self._kv.tree, cfg)
            if (cfg.cache_aware_order and self._kv.caching)
            else self._waiting
        )
        admitted: list[Sequence] = []
        for seq in ranked:
            if budget <= 0 or len(self._running) >= cfg.max_num_seqs:
                break
            request = seq.request
            if seq.index > 0 and not request.prompt_done:
                continue  # waits to fork from completion 0 instead of computing the prompt again
            count = self._admit(seq, plan, scheduled, budget)
            if count == 0:
                break  # head-of-line: later arrivals must not overtake a request waiting for memory
            budget -= count
            admitted.append(seq)
        if admitted:
            if ranked is not self._waiting:
                admission.count_skips(ranked, admitted, cfg.cache_aware_window)
            self._waiting = [s for s in self._waiting if s.status is not _RUNNING]

    def _admit(self, seq: Sequence, plan: StepPlan, scheduled: list[tuple[Sequence, int, bool]], budget: int) -> int:
        """Start `seq` if the pool can hold all its known tokens; return tokens scheduled (0: no room)."""
        match, forked = self._kv.find_prefix(seq, self._step_id)
        count = self._kv.admit(seq, match, forked, budget, plan)
        if count == 0:
            return 0
        request = seq.request
        if request.queue_time_s is None:
            request.num_cached_tokens = seq.num_computed
        self._start_running(seq, count, plan, scheduled)
        return count

    def _start_running(
        self, seq: Sequence, count: int, plan: StepPlan, scheduled: list[tuple[Sequence, int, bool]]
    ) -> None:
        """Send `seq` to the executor as a NewSequence and put it in the running list."""
        request = seq.request
        if request.queue_time_s is None:
            request.queue_time_s = self._clock() - request.arrival_time
        seq.status = _RUNNING
        seq.started_step = self._step_id
        bisect.insort(self._running, seq, key=QUEUE_ORDER)
        num_tokens = len(seq.token_ids)
        plan.new_seqs.append(
            NewSequence(
                seq.seq_id,
                list(seq.token_ids),
                seq.prompt_len,
                seq.num_computed,
                count,
                list(seq.block_table),
                request.sampling,
                seq.seed,
            )
        )
        seq.known = True
        seq.sent_tokens = num_tokens
        seq.sent_blocks = len(seq.block_table)
        scheduled.append((seq, count, seq.num_computed + count == num_tokens))

    # --- preemption ------------------------------------------------------------------

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Take a running sequence off the device: swap it to CPU if configured and possible, else recompute."""
        assert self._running[-1] is seq
        self._running.pop()
        self._num_preemptions += 1
        plan.drop_seq_ids.append(seq.seq_id)
        seq.known = False
        seq.sent_tokens = seq.sent_blocks = 0
        if self.config.preemption_mode == "swap" and self._kv.swap_out(seq, plan):
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self._swapped, seq, key=QUEUE_ORDER)
            log.debug("preempted", seq_id=seq.seq_id, mode="swap", blocks=len(seq.cpu_table))
            return
        self._kv.forget(seq)
        seq.status = SequenceStatus.PREEMPTED
        bisect.insort(self._waiting, seq, key=QUEUE_ORDER)
        log.debug("preempted", seq_id=seq.seq_id, mode="recompute", tokens=len(seq.token_ids))
