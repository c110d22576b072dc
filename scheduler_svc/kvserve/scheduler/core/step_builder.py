"""Step building: turns the queues into one StepPlan per step (the per-step hot path).

Each step packs, within `max_num_batched_tokens` and `max_num_seqs`:

1. running sequences in priority order: decodes (one token, plus any draft tokens that
   speculative decoding proposes) first, then the next chunk of any partly computed prompt;
   when a block is missing, the lowest-priority, latest-arrived running sequence is
   preempted (recompute, or swap to CPU);
2. swapped-out sequences, swapped back in, in priority order;
3. waiting sequences, admitted after a prefix-cache match (or a fork from completion 0
   for n > 1) if the pool can hold their whole known tokens.

Steps 2 and 3 are skipped in a step that had to preempt. Building a plan advances no
sequence: the `ResultApplier` does that once the step is confirmed, so a plan lost with
its executor leaves nothing half-done. Per step the work is O(scheduled sequences); the
tree is touched only at admission and when a block fills. Kept apart from `Scheduler`
(the request lifecycle) so the plan-building rules read in one place.
"""

from __future__ import annotations

import bisect

import structlog

from kvserve.protos.step import KnownSequence, NewSequence, StepPlan
from kvserve.scheduler.core import admission
from kvserve.scheduler.core.draft_proposer import DraftProposer
from kvserve.scheduler.core.request import QUEUE_ORDER, Sequence, SequenceStatus
from kvserve.scheduler.core.scheduler_state import InFlight, ScheduledSequence, SchedulerState
from kvserve.scheduler.core.token_matcher import constrained_drafts

log = structlog.get_logger(__name__)

_RUNNING = SequenceStatus.RUNNING


def _count_decodes(running: list[Sequence], start: int) -> int:
    count = 0
    for index in range(start, len(running)):
        seq = running[index]
        if len(seq.token_ids) - seq.num_computed == 1:
            count += 1
    return count


def _attach_masks(plan: StepPlan, scheduled: list[ScheduledSequence]) -> None:
    """The bitmask of every constrained sequence that samples this step (structured output).

    One pass over the scheduled list: an unconstrained batch pays one attribute test per
    sequence and sends no mask bytes. A sequence verifying drafts has a row per position, in order.
    """
    ids: list[int] = []
    masks: list[bytes] = []
    for s in scheduled:
        matcher = s.seq.matcher
        if matcher is None or not s.samples:
            continue
        if s.masks is None:
            ids.append(s.seq.seq_id)
            masks.append(matcher.next_token_bitmask())
        else:  # verifying drafts: one row per position, built with the drafts
            ids.extend([s.seq.seq_id] * len(s.masks))
            masks.extend(s.masks)
    if ids:
        plan.mask_seq_ids = ids
        plan.token_masks = b"".join(masks)


def _draft_requests(scheduled: list[ScheduledSequence], k: int) -> list[tuple[int, int]]:
    """(seq_id, count) for every sequence that samples this step and may still use drafts next step
    (`--speculative draft`: the executor's draft model proposes them after this step's tokens)."""
    requests = []
    for s in scheduled:
        seq = s.seq
        if not s.samples or seq.draft_pause:
            continue
        # Next step yields its accepted drafts plus one, after at least this step's token.
        left = seq.request.max_output_tokens - (len(seq.token_ids) - seq.prompt_len) - 2
        if left > 0:
            requests.append((seq.seq_id, min(k, left)))
    return requests


_LOADING = -1
"""`_admit`'s answer for a sequence that waits a step for its prefix to load from disk."""


class StepBuilder:
    """`build()`: packs running, swapped and waiting sequences into one plan; preempts when blocks run out."""

    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self._num_drafts = 0
        """Draft tokens in the plan being built."""

    def build(self) -> StepPlan:
        """The next plan, recorded as in flight unless empty (an empty plan needs no step)."""
        st = self.state
        st.step_id += 1
        plan = StepPlan(step_id=st.step_id, drop_seq_ids=st.pending_drops, trims=st.pending_trims)
        st.pending_drops = []
        st.pending_trims = []
        if st.kv.disk is not None:
            st.kv.disk.take_stores(plan)  # first: this plan may reuse a block the disk must get first
        scheduled: list[ScheduledSequence] = []
        budget, preempted = self._schedule_running(plan, scheduled)
        if not preempted:
            budget = self._schedule_swapped(plan, scheduled, budget)
            if not st.swapped:
                self._schedule_waiting(plan, scheduled, budget)
        st.kv.unpin()
        if plan.trims and plan.drop_seq_ids:  # a sequence that ended or was preempted since is dropped whole
            dropped = set(plan.drop_seq_ids)
            plan.trims = [trim for trim in plan.trims if trim[0] not in dropped]
        _attach_masks(plan, scheduled)
        proposer = st.proposer
        if proposer is not None and proposer.from_executor and len(st.running) <= st.config.speculative_max_batch:
            plan.draft_requests = _draft_requests(scheduled, st.config.num_speculative_tokens)
        if not plan.is_empty:
            st.inflight = InFlight(plan.step_id, scheduled, self._num_drafts)
        return plan

    def _schedule_running(self, plan: StepPlan, scheduled: list[ScheduledSequence]) -> tuple[int, bool]:
        st = self.state
        running = st.running
        bs = st.block_size
        cfg = st.config
        budget = cfg.max_num_batched_tokens
        # Drafts only where the step is overhead-bound (few sequences), from budget left after one token each.
        proposer = st.proposer if len(running) <= cfg.speculative_max_batch else None
        self._num_drafts = 0
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
            drafts = None
            masks: list[bytes] | None = None
            if num_tokens - computed == 1:
                count = 1
                if decodes_left is not None:
                    decodes_left -= 1
                if proposer is not None:
                    drafts = self._propose(proposer, seq, budget - (len(running) - i))
                    if drafts and seq.matcher is not None:
                        drafts, masks = constrained_drafts(seq.matcher, drafts)
                    count += len(drafts)
            else:
                if decodes_left is None:
                    decodes_left = _count_decodes(running, i + 1)
                count = min(num_tokens - computed, budget - decodes_left)
                if count <= 0:
                    i += 1
                    continue
            table = seq.block_table
            if drafts and computed + count > len(table) * bs:
                drafts = self._fit_drafts(seq, drafts)
                count = 1 + len(drafts)
                if masks is not None:
                    del masks[count:]
            if computed + count > len(table) * bs:
                preemptions_before = st.num_preemptions
                new_blocks = self._allocate_or_preempt(seq, (computed + count + bs - 1) // bs - len(table), plan)
                if st.num_preemptions != preemptions_before:
                    preempted = True
                    decodes_left = None  # victims may have been decodes: recount when needed
                if new_blocks is None:  # `seq` itself was preempted (it was last in `running`)
                    continue
                table.extend(new_blocks)
            budget -= count
            if drafts:
                self._num_drafts += len(drafts)
                add_cached(
                    KnownSequence(
                        seq.seq_id, tokens[seq.sent_tokens :], computed, count, table[seq.sent_blocks :], drafts
                    )
                )
                add_scheduled(ScheduledSequence(seq, count, True, drafts, masks if drafts else None))
            else:
                add_cached(
                    KnownSequence(seq.seq_id, tokens[seq.sent_tokens :], computed, count, table[seq.sent_blocks :])
                )
                add_scheduled(ScheduledSequence(seq, count, computed + count == num_tokens))
            seq.sent_tokens = num_tokens
            seq.sent_blocks = len(table)
            i += 1
        return budget, preempted

    def _fit_drafts(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """`drafts` with blocks to hold them, or as many as the table holds: drafts never preempt anyone."""
        bs, table = self.state.block_size, seq.block_table
        end = seq.num_computed + 1 + len(drafts)
        blocks = self.state.kv.allocate(seq, (end + bs - 1) // bs - len(table))
        if blocks is not None:
            table.extend(blocks)
            return drafts
        return drafts[: max(0, len(table) * bs - seq.num_computed - 1)]

    def _propose(self, proposer: DraftProposer, seq: Sequence, room: int) -> list[int]:
        """Draft tokens for a decoding sequence: at most `room` - 1, none past its output limit or while paused."""
        if seq.draft_pause:
            seq.draft_pause -= 1
            return []
        cfg = self.state.config
        tokens = seq.token_ids
        # The step yields the accepted drafts plus one: never more than the request may still output.
        left = seq.request.max_output_tokens - (len(tokens) - seq.prompt_len) - 1
        limit = min(cfg.num_speculative_tokens, room - 1, left)
        if limit <= 0:
            return []
        return proposer.propose(seq, limit)[:limit]

    def _allocate_or_preempt(self, seq: Sequence, need: int, plan: StepPlan) -> list[int] | None:
        """`need` blocks for `seq`, preempting from the tail of `running` until they fit (None: `seq` went)."""
        kv, running = self.state.kv, self.state.running
        blocks = kv.allocate(seq, need)
        while blocks is None:
            victim = running[-1]
            self._preempt(victim, plan)
            if victim is seq:
                return None
            blocks = kv.allocate(seq, need)
        return blocks

    def _schedule_swapped(self, plan: StepPlan, scheduled: list[ScheduledSequence], budget: int) -> int:
        # Runs after every swap-out of this plan, so the CPU blocks it frees are not reused before they are read.
        st = self.state
        while st.swapped and budget > 0 and len(st.running) < st.config.max_num_seqs:
            seq = st.swapped[0]
            count = min(len(seq.token_ids) - seq.num_computed, budget)
            if not st.kv.swap_in(seq, count, plan):
                break
            del st.swapped[0]
            self._start_running(seq, count, plan, scheduled)
            budget -= count
        return budget

    def _schedule_waiting(self, plan: StepPlan, scheduled: list[ScheduledSequence], budget: int) -> None:
        st = self.state
        if not st.waiting:
            return
        cfg = st.config
        ranked = (
            admission.admission_order(st.waiting, st.kv.tree, cfg)
            if (cfg.cache_aware_order and st.kv.caching)
            else st.waiting
        )
        admitted: list[Sequence] = []
        for seq in ranked:
            if budget <= 0 or len(st.running) >= cfg.max_num_seqs:
                break
            request = seq.request
            if seq.index > 0 and not request.prompt_done:
                continue  # waits to fork from completion 0 instead of computing the prompt again
            count = self._admit(seq, plan, scheduled, budget)
            if count == _LOADING:
                continue  # its prefix comes from disk this step; it is admitted with a hit on the next
            if count == 0:
                break  # head-of-line: later arrivals must not overtake a request waiting for memory
            budget -= count
            admitted.append(seq)
        if admitted:
            if ranked is not st.waiting:
                admission.count_skips(ranked, admitted, cfg.cache_aware_window)
            st.waiting = [s for s in st.waiting if s.status is not _RUNNING]

    def _admit(self, seq: Sequence, plan: StepPlan, scheduled: list[ScheduledSequence], budget: int) -> int:
        """Start `seq` if the pool can hold all its known tokens; return tokens scheduled (0: no room,
        `_LOADING`: it waits for its prefix's blocks to come from the tiers below the pool)."""
        kv = self.state.kv
        disk = kv.disk
        if (
            disk is not None
            and seq.index == 0
            and not seq.request.lora_name
            and disk.start_loads(kv.tree, kv.pool, seq.request, seq.token_ids, plan)
        ):
            return _LOADING
        match, forked = kv.find_prefix(seq, self.state.step_id)
        count = kv.admit(seq, match, forked, budget, plan)
        if count == 0:
            return 0
        request = seq.request
        if request.queue_time_s is None:
            request.num_cached_tokens = seq.num_computed
            # Loaded for it, then matched: a block evicted again before admission was recomputed.
            request.num_disk_cached_tokens = min(request.num_disk_cached_tokens, seq.num_computed)
            request.num_host_cached_tokens = min(
                request.num_host_cached_tokens, seq.num_computed - request.num_disk_cached_tokens
            )
        self._start_running(seq, count, plan, scheduled)
        return count

    def _start_running(self, seq: Sequence, count: int, plan: StepPlan, scheduled: list[ScheduledSequence]) -> None:
        """Send `seq` to the executor as a NewSequence and put it in the running list."""
        st = self.state
        request = seq.request
        if request.queue_time_s is None:
            request.queue_time_s = st.clock() - request.arrival_time
        seq.status = _RUNNING
        seq.started_step = st.step_id
        bisect.insort(st.running, seq, key=QUEUE_ORDER)
        num_tokens = len(seq.token_ids)
        plan.new_seqs.append(
            NewSequence(
                seq_id=seq.seq_id,
                token_ids=list(seq.token_ids),
                prompt_len=seq.prompt_len,
                num_computed_tokens=seq.num_computed,
                num_scheduled_tokens=count,
                block_table=list(seq.block_table),
                sampling=request.sampling,
                seed=seq.seed,
                lora_name=request.lora_name,
            )
        )
        seq.known = True
        seq.sent_tokens = num_tokens
        seq.sent_blocks = len(seq.block_table)
        scheduled.append(ScheduledSequence(seq, count, seq.num_computed + count == num_tokens))

    # --- preemption ------------------------------------------------------------------

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Take a running sequence off the device: swap it to CPU if configured and possible, else recompute."""
        st = self.state
        assert st.running[-1] is seq
        st.running.pop()
        st.num_preemptions += 1
        plan.drop_seq_ids.append(seq.seq_id)
        seq.known = False
        seq.sent_tokens = seq.sent_blocks = 0
        if st.config.preemption_mode == "swap" and st.kv.swap_out(seq, plan):
            seq.status = SequenceStatus.SWAPPED
            st.num_swap_outs += 1
            bisect.insort(st.swapped, seq, key=QUEUE_ORDER)
            log.debug("preempted", seq_id=seq.seq_id, mode="swap", blocks=len(seq.cpu_table))
            return
        st.kv.forget(seq)
        seq.status = SequenceStatus.PREEMPTED
        bisect.insort(st.waiting, seq, key=QUEUE_ORDER)
        log.debug("preempted", seq_id=seq.seq_id, mode="recompute", tokens=len(seq.token_ids))
