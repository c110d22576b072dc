"""The continuous-batching scheduler: turns request state into one StepPlan per step.

Each step packs, within `max_num_batched_tokens` and `max_num_seqs`:

1. running sequences in priority order: decodes (one token) first, then the next chunk
   of any partly computed prompt; when a block is missing, the lowest-priority,
   latest-arrived running sequence is preempted (recompute, or swap to CPU);
2. swapped-out sequences, swapped back in, in priority order;
3. waiting sequences, admitted after a prefix-cache match (or a fork from completion 0
   for n > 1) if the pool can hold their whole known tokens.

Steps 2 and 3 are skipped in a step that had to preempt. Sequences only advance when
`update()` confirms the step, so a plan lost with its executor leaves nothing half-done.
Per step the work is O(scheduled sequences); the tree is touched only at admission and
when a block fills.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence as SequenceOf
from dataclasses import dataclass
from operator import attrgetter

import structlog

from protos.sampling import InvalidFieldError, SamplingParams
from protos.step import KnownSequence, NewSequence, StepPlan, StepResult
from scheduler_svc.core import admission, invariants
from scheduler_svc.core.kv_manager import KvManager
from scheduler_svc.core.outputs import SampledLogprob, SchedulerStats, SequenceOutput
from scheduler_svc.core.request import WAITING_STATES, Request, RequestRejected, Sequence, SequenceStatus, derive_seed, resolve_seed
from protos.stop_rules import FinishReason
from scheduler_svc.core.scheduler_config import SchedulerConfig
from protos.stop_rules import stop_reason

log = structlog.get_logger(__name__)

_sort_key = attrgetter("sort_key")
_RUNNING = SequenceStatus.RUNNING


def _count_decodes(running: list[Sequence], start: int) -> int:
    count = 0
    for index in range(start, len(running)):
        seq = running[index]
        if len(seq.token_ids) - seq.num_computed == 1:
            count += 1
    return count


@dataclass(slots=True)
class _InFlight:
    step_id: int
    scheduled: list[tuple[Sequence, int, bool]]
    """(sequence, tokens scheduled, whether it samples) for every scheduled sequence."""


class Scheduler:
    """Owns every request, the block pool and the prefix tree; one plan in flight at a time."""

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
        self._inflight: _InFlight | None = None
        self._next_seq_id = 0
        self._next_order = 0
        self._step_id = 0
        self._num_steps = 0
        self._num_preemptions = 0
        self._kv = KvManager(config.num_blocks, config.block_size, config.num_cpu_blocks,
                             config.enable_prefix_caching)

    # --- requests --------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: SequenceOf[int], sampling: SamplingParams, *,
                    priority: int = 0, namespace: str = "", arrival_time: float | None = None) -> None:
        """Queue a request; raise RequestRejected if it could never be served.

        Lower `priority` is served first; FCFS within a priority. Requests in different
        `namespace`s never share KV blocks.
        """
        if request_id in self._requests:
            raise RequestRejected("request_id", f"a request with id {request_id!r} is still in progress")
        try:
            sampling.validate()
        except InvalidFieldError as exc:
            raise RequestRejected(exc.field, exc.reason) from exc
        prompt = list(prompt_token_ids)
        self._check_fits(prompt, sampling)
        arrival = self._clock() if arrival_time is None else arrival_time
        seed = resolve_seed(sampling.seed)
        request = Request(request_id, prompt, sampling, priority, namespace, arrival, self._next_order, seed)
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= self._eos
        request.stop_ids = frozenset(stop_ids)
        request.max_output_tokens = min(sampling.max_tokens, self.config.max_model_len - len(prompt))
        self._next_order += 1
        for index in range(sampling.n):
            self._next_seq_id += 1
            seq = Sequence(self._next_seq_id, request, index, list(prompt), len(prompt),
                           derive_seed(seed, index), (priority, arrival, request.order, index))
            request.seqs.append(seq)
            bisect.insort(self._waiting, seq, key=_sort_key)
        request.num_unfinished = sampling.n
        self._requests[request_id] = request

    def _check_fits(self, prompt: list[int], sampling: SamplingParams) -> None:
        cfg = self.config
        if not prompt:
            raise RequestRejected("prompt", "must contain at least one token")
        if min(prompt) < 0:
            raise RequestRejected("prompt", "token ids must be non-negative")
        if len(prompt) >= cfg.max_model_len:
            raise RequestRejected("prompt", f"{len(prompt)} tokens leave no room for output "
                                            f"within max_model_len={cfg.max_model_len}")
        total = len(prompt) + sampling.max_tokens
        if total > cfg.max_model_len:
            raise RequestRejected("max_tokens", f"prompt ({len(prompt)} tokens) + max_tokens "
                                                f"({sampling.max_tokens}) exceeds max_model_len={cfg.max_model_len}")
        # The last sampled token is never computed, so the KV holds at most total - 1 tokens.
        blocks = -(-(total - 1) // self._bs)
        if blocks > self._kv.pool.num_blocks:
            raise RequestRejected("max_tokens", f"prompt + max_tokens ({total} tokens) needs {blocks} KV blocks "
                                                f"but the cache holds only {self._kv.pool.num_blocks}")

    def has_unfinished(self) -> bool:
        return bool(self._requests)

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
        if not plan.is_empty:
            self._inflight = _InFlight(plan.step_id, scheduled)
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
            add_cached(KnownSequence(seq.seq_id, tokens[seq.sent_tokens:], computed, count,
                                      table[seq.sent_blocks:]))
            seq.sent_tokens = num_tokens
            seq.sent_blocks = len(table)
            add_scheduled((seq, count, computed + count == num_tokens))
            i += 1
        return budget, preempted

    def _allocate_or_preempt(self, seq: Sequence, need: int, plan: StepPlan) -> list[int] | None:
        """`need` blocks for `seq`, preempting from the tail of `running` until they fit (None: `seq` went)."""
        blocks = self._kv.allocate(need)
        while blocks is None:
            victim = self._running[-1]
            self._preempt(victim, plan)
            if victim is seq:
                return None
            blocks = self._kv.allocate(need)
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
        ranked = admission.admission_order(self._waiting, self._kv.tree, cfg) if (
            cfg.cache_aware_order and self._kv.caching) else self._waiting
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

    def _start_running(self, seq: Sequence, count: int, plan: StepPlan,
                       scheduled: list[tuple[Sequence, int, bool]]) -> None:
        """Send `seq` to the executor as a NewSequence and put it in the running list."""
        request = seq.request
        if request.queue_time_s is None:
            request.queue_time_s = self._clock() - request.arrival_time
        seq.status = _RUNNING
        seq.started_step = self._step_id
        bisect.insort(self._running, seq, key=_sort_key)
        num_tokens = len(seq.token_ids)
        plan.new_seqs.append(NewSequence(seq.seq_id, list(seq.token_ids), seq.prompt_len, seq.num_computed, count,
                                         list(seq.block_table), request.sampling, seq.seed))
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
            bisect.insort(self._swapped, seq, key=_sort_key)
            log.debug("preempted", seq_id=seq.seq_id, mode="swap", blocks=len(seq.cpu_table))
            return
        self._kv.forget(seq)
        seq.status = SequenceStatus.PREEMPTED
        bisect.insort(self._waiting, seq, key=_sort_key)
        log.debug("preempted", seq_id=seq.seq_id, mode="recompute", tokens=len(seq.token_ids))

    # --- results ---------------------------------------------------------------------

    def update(self, result: StepResult) -> list[SequenceOutput]:
        """Apply the executor's result for the last plan: advance, append tokens, stop, emit outputs."""
        inflight = self._inflight
        if inflight is None or result.step_id != inflight.step_id:
            log.warning("ignoring a result for a step not in flight", step_id=result.step_id,
                        in_flight=inflight.step_id if inflight else None)
            return []
        outputs: list[SequenceOutput] = []
        self._inflight = None
        self._num_steps += 1
        now = self._clock()
        by_id = {out.seq_id: out for out in result.outputs}
        get_sampled = by_id.get
        add_output = outputs.append
        bs = self._bs
        kv = self._kv
        caching = kv.caching
        any_finished = False
        for seq, count, samples in inflight.scheduled:
            if seq.status is not _RUNNING:
                continue  # aborted or finished while the step ran: its token is ignored
            computed = seq.num_computed + count
            seq.num_computed = computed
            if computed // bs > seq.num_tree_blocks and caching and not seq.cache_frozen:
                kv.cache_full_blocks(seq)
            if not samples:
                continue
            request = seq.request
            sampled = get_sampled(seq.seq_id)
            if sampled is None:
                log.error("executor returned no token for a sampling sequence", seq_id=seq.seq_id,
                          request_id=request.request_id)
                self._finish(seq, FinishReason.ERROR, remove=False)
                any_finished = True
                add_output(self._output(seq, [], None, FinishReason.ERROR))
                continue
            token = sampled.token_id
            tokens = seq.token_ids
            tokens.append(token)
            num_output = len(tokens) - seq.prompt_len
            reason = None
            if token in request.stop_ids or num_output >= request.max_output_tokens:
                reason = stop_reason(request.sampling, token, num_output, len(tokens), self._eos,
                                     self.config.max_model_len)
            if request.ttft_s is None:
                request.ttft_s = now - request.arrival_time
            if not request.prompt_done and seq.index == 0:
                request.prompt_done = True
            logprobs = None
            if request.sampling.logprobs is not None:
                logprob = sampled.logprob if sampled.logprob is not None else float("nan")
                logprobs = [SampledLogprob(token, logprob, list(sampled.top_logprobs))]
            if reason is not None:
                self._finish(seq, reason, remove=False)
                any_finished = True
            add_output(SequenceOutput(request.request_id, seq.index, [token], logprobs, reason, seq.prompt_len,
                                      request.num_cached_tokens, num_output, request.queue_time_s, request.ttft_s))
        if any_finished:
            self._running = [s for s in self._running if s.status is _RUNNING]
        if self.config.debug_invariants:
            self.check_invariants()
        return outputs

    def _output(self, seq: Sequence, tokens: list[int], logprobs: list[SampledLogprob] | None,
                reason: FinishReason | None) -> SequenceOutput:
        """An output outside the update() fast path (abort, finish, errors)."""
        request = seq.request
        if logprobs is None and request.sampling.logprobs is not None:
            logprobs = []
        return SequenceOutput(request.request_id, seq.index, tokens, logprobs, reason, seq.prompt_len,
                              request.num_cached_tokens, len(seq.token_ids) - seq.prompt_len,
                              request.queue_time_s, request.ttft_s)

    # --- ending sequences ------------------------------------------------------------

    def _finish(self, seq: Sequence, reason: FinishReason, *, remove: bool = True) -> None:
        """End one sequence in any state and return all its blocks. `remove=False`: caller prunes `running`."""
        status = seq.status
        if status is _RUNNING:
            if remove:
                self._running.remove(seq)
        elif status in WAITING_STATES:
            self._waiting.remove(seq)
        elif status is SequenceStatus.SWAPPED:
            self._swapped.remove(seq)
            self._kv.release_swapped(seq)
        self._kv.release(seq)
        if seq.known:
            self._pending_drops.append(seq.seq_id)
            seq.known = False
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        request = seq.request
        if seq.index == 0:
            request.prompt_done = True  # completions waiting to fork from it fall back to a prefix match
        request.num_unfinished -= 1
        if request.num_unfinished == 0:
            del self._requests[request.request_id]

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> list[SequenceOutput]:
        """End a request in any state; one final output per unfinished completion ([] if unknown)."""
        request = self._requests.get(request_id)
        if request is None:
            return []
        outputs = []
        for seq in request.seqs:
            if not seq.is_finished:
                self._finish(seq, reason)
                outputs.append(self._output(seq, [], None, reason))
        return outputs

    def finish_sequence(self, request_id: str, index: int,
                        reason: FinishReason = FinishReason.STOP) -> SequenceOutput | None:
        """Stop-string hook: end completion `index` now (None if unknown or already finished)."""
        request = self._requests.get(request_id)
        if request is None or not 0 <= index < len(request.seqs) or request.seqs[index].is_finished:
            return None
        seq = request.seqs[index]
        self._finish(seq, reason)
        return self._output(seq, [], None, reason)

    def fail_all(self, reason: FinishReason = FinishReason.ERROR) -> list[SequenceOutput]:
        """End every request (no executor came back in time) and return every block."""
        outputs = []
        for request_id in list(self._requests):
            outputs.extend(self.abort(request_id, reason))
        self._inflight = None
        return outputs

    def reset_executor(self, num_blocks: int | None = None) -> list[SequenceOutput]:
        """The executor was replaced and its KV is gone: requeue every sequence for recompute.

        Generated tokens are kept; the plan in flight (if any) is void. Requests that no
        longer fit a smaller pool are finished with ERROR: their final outputs are returned.
        """
        self._inflight = None
        for seq in self._running + self._swapped:
            seq.cpu_table = []
            seq.block_table = []
            seq.status = SequenceStatus.PREEMPTED
            bisect.insort(self._waiting, seq, key=_sort_key)
        for seq in self._waiting:
            seq.num_computed = 0
            seq.known = False
            seq.sent_tokens = seq.sent_blocks = 0
            seq.tree_node, seq.num_tree_blocks, seq.cache_frozen = None, 0, False
        self._running, self._swapped = [], []
        self._pending_drops = []
        if num_blocks is not None:
            self.config.num_blocks = num_blocks
        cfg = self.config
        self._kv = KvManager(cfg.num_blocks, cfg.block_size, cfg.num_cpu_blocks, cfg.enable_prefix_caching,
                             previous=self._kv)
        outputs = []
        for request in list(self._requests.values()):
            try:
                self._check_fits(request.prompt_token_ids, request.sampling)
            except RequestRejected as exc:
                log.warning("request no longer fits the new executor", request_id=request.request_id, reason=str(exc))
                outputs.extend(self.abort(request.request_id, FinishReason.ERROR))
        log.info("scheduler re-synced for a new executor", num_blocks=self.config.num_blocks,
                 requeued=len(self._waiting))
        return outputs

    # --- introspection ---------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        pool, cpu, tree = self._kv.pool, self._kv.cpu, self._kv.tree
        referenced = pool.num_referenced
        return SchedulerStats(
            num_waiting=len(self._waiting), num_running=len(self._running), num_swapped=len(self._swapped),
            num_blocks=pool.num_blocks, blocks_free=pool.num_free, blocks_cached=pool.num_cached,
            blocks_referenced=referenced, kv_usage=referenced / pool.num_blocks,
            prefix_queried_tokens=tree.queried_tokens, prefix_hit_tokens=tree.hit_tokens,
            num_preemptions=self._num_preemptions, num_cpu_blocks=cpu.num_blocks,
            cpu_blocks_used=cpu.num_blocks - cpu.num_free, num_steps=self._num_steps,
            num_requests=len(self._requests),
        )

    def ref_count(self, block_id: int) -> int:
        """How many live block tables hold device block `block_id` (for tests and debugging)."""
        return self._kv.pool.ref_counts[block_id]

    def check_invariants(self) -> None:
        """Raise InvariantError (an AssertionError) naming the first broken KV/queue invariant."""
        invariants.check(self)

    def debug_dump(self) -> str:
        """Every live sequence's block table with ref counts, plus pool and tree summaries."""
        return invariants.dump(self)
