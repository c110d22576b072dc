"""The continuous-batching scheduler: the request lifecycle around the step builder.

`Scheduler` is the core's one entry point. It queues requests (`add_request`, which
asserts the preconditions the API edge validated and rejects only what exceeds the
KV capacity), applies each step's result (`update`: advance, append tokens, stop) and
ends sequences (`abort`, `finish_sequence`, `fail_all`, `reset_executor`). Building
the plans is `StepBuilder`'s job and the read-only introspection is `SchedulerState`'s,
so each module holds one concern.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence as SequenceOf

import structlog

from protos.sampling import InvalidFieldError, SamplingParams
from protos.step import StepResult
from protos.stop_rules import FinishReason, stop_reason, stop_token_ids
from scheduler_svc.core.kv_manager import KvManager
from scheduler_svc.core.outputs import SampledLogprob, SequenceOutput
from scheduler_svc.core.request import (
    QUEUE_ORDER,
    WAITING_STATES,
    Request,
    RequestRejected,
    Sequence,
    SequenceStatus,
    derive_seed,
    resolve_seed,
)
from scheduler_svc.core.step_builder import StepBuilder
from scheduler_svc.core.token_matcher import MatcherFactory

log = structlog.get_logger(__name__)

_RUNNING = SequenceStatus.RUNNING


def _sampling_problem(sampling: SamplingParams) -> str | None:
    """Why `sampling` is out of range (None: it is not). Only evaluated inside `assert`."""
    try:
        sampling.validate()
    except InvalidFieldError as exc:
        return str(exc)
    return None


class Scheduler(StepBuilder):
    """Owns every request, the block pool and the prefix tree; one plan in flight at a time."""

    # --- requests --------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        sampling: SamplingParams,
        *,
        priority: int = 0,
        namespace: str = "",
        arrival_time: float | None = None,
        constraint: MatcherFactory | None = None,
    ) -> None:
        """Queue a request; raise RequestRejected if it could never fit the KV capacity.

        Lower `priority` is served first; FCFS within a priority. Requests in different
        `namespace`s never share KV blocks. The caller has validated the request (see
        `scheduler_svc.server.request_parsing`): a reused id, an empty prompt, a negative
        token id or out-of-range sampling fail an assertion here, not a validation.
        A `constraint` (structured output) gives each completion its own matcher.
        """
        assert request_id not in self._requests, f"request id {request_id!r} is still in progress"
        prompt = list(prompt_token_ids)
        assert prompt and min(prompt) >= 0, "the prompt must be non-empty, non-negative token ids"
        assert (problem := _sampling_problem(sampling)) is None, problem
        self._check_fits(prompt, sampling)
        arrival = self._clock() if arrival_time is None else arrival_time
        seed = resolve_seed(sampling.seed)
        request = Request(request_id, prompt, sampling, priority, namespace, arrival, self._next_order, seed)
        request.stop_ids = stop_token_ids(sampling, self._eos)
        request.max_output_tokens = min(sampling.max_tokens, self.config.max_model_len - len(prompt))
        request.reserve_blocks = self.config.reserved_blocks(len(prompt), sampling.max_tokens)
        self._next_order += 1
        for index in range(sampling.n):
            self._next_seq_id += 1
            seq = Sequence(
                self._next_seq_id,
                request,
                index,
                list(prompt),
                len(prompt),
                derive_seed(seed, index),
                (priority, arrival, request.order, index),
            )
            if constraint is not None:
                seq.matcher = constraint.new_matcher()
            request.seqs.append(seq)
            bisect.insort(self._waiting, seq, key=QUEUE_ORDER)
        request.num_unfinished = sampling.n
        self._requests[request_id] = request

    def _check_fits(self, prompt: list[int], sampling: SamplingParams) -> None:
        """Raise RequestRejected naming "prompt" or "max_tokens" if the request can never fit this pool."""
        cfg = self.config
        if len(prompt) >= cfg.max_model_len:
            raise RequestRejected(
                "prompt", f"{len(prompt)} tokens leave no room for output within max_model_len={cfg.max_model_len}"
            )
        total = len(prompt) + sampling.max_tokens
        if total > cfg.max_model_len:
            raise RequestRejected(
                "max_tokens",
                f"prompt ({len(prompt)} tokens) + max_tokens "
                f"({sampling.max_tokens}) exceeds max_model_len={cfg.max_model_len}",
            )
        # The last sampled token is never computed, so the KV holds at most total - 1 tokens.
        blocks = -(-(total - 1) // self._bs)
        if blocks > self._kv.pool.num_blocks:
            raise RequestRejected(
                "max_tokens",
                f"prompt + max_tokens ({total} tokens) needs {blocks} KV blocks "
                f"but the cache holds only {self._kv.pool.num_blocks}",
            )
        reserved = cfg.reserved_blocks(len(prompt), sampling.max_tokens)
        if reserved > self._kv.pool.num_blocks:
            raise RequestRejected(
                "max_tokens",
                f"kv_reservation={cfg.kv_reservation} reserves {reserved} KV blocks per sequence "
                f"but the cache holds only {self._kv.pool.num_blocks}",
            )

    # --- results ---------------------------------------------------------------------

    def update(self, result: StepResult) -> list[SequenceOutput]:
        """Apply the executor's result for the last plan: advance, append tokens, stop, emit outputs."""
        inflight = self._inflight
        if inflight is None or result.step_id != inflight.step_id:
            log.warning(
                "ignoring a result for a step not in flight",
                step_id=result.step_id,
                in_flight=inflight.step_id if inflight else None,
            )
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
                log.error(
                    "executor returned no token for a sampling sequence",
                    seq_id=seq.seq_id,
                    request_id=request.request_id,
                )
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
                reason = stop_reason(
                    request.sampling, token, num_output, len(tokens), self._eos, self.config.max_model_len
                )
            if seq.matcher is not None and reason is None:
                reason = self._advance_matcher(seq, token)
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
            add_output(
                SequenceOutput(
                    request.request_id,
                    seq.index,
                    [token],
                    logprobs,
                    reason,
                    seq.prompt_len,
                    request.num_cached_tokens,
                    num_output,
                    request.queue_time_s,
                    request.ttft_s,
                    request.blocks,
                )
            )
        if any_finished:
            self._running = [s for s in self._running if s.status is _RUNNING]
        if self.config.debug_invariants:
            self.check_invariants()
        return outputs

    @staticmethod
    def _advance_matcher(seq: Sequence, token: int) -> FinishReason | None:
        """Feed a constrained completion's token to its grammar: GRAMMAR once it admits nothing more."""
        matcher = seq.matcher
        assert matcher is not None
        if not matcher.accept(token):
            # The plan's mask forbade it: an executor that ignored the mask, never a client error.
            log.error("executor sampled a token the grammar forbids", seq_id=seq.seq_id, token_id=token)
            return FinishReason.ERROR
        return FinishReason.GRAMMAR if matcher.is_finished else None

    def _output(
        self, seq: Sequence, tokens: list[int], logprobs: list[SampledLogprob] | None, reason: FinishReason | None
    ) -> SequenceOutput:
        """An output outside the update() fast path (abort, finish, errors)."""
        request = seq.request
        if logprobs is None and request.sampling.logprobs is not None:
            logprobs = []
        return SequenceOutput(
            request.request_id,
            seq.index,
            tokens,
            logprobs,
            reason,
            seq.prompt_len,
            request.num_cached_tokens,
            len(seq.token_ids) - seq.prompt_len,
            request.queue_time_s,
            request.ttft_s,
            request.blocks,
        )

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

    def finish_sequence(
        self, request_id: str, index: int, reason: FinishReason = FinishReason.STOP
    ) -> SequenceOutput | None:
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
            seq.request.blocks.freed += len(seq.block_table)  # references dropped with the old pool
            seq.cpu_table = []
            seq.block_table = []
            seq.reserved_blocks = 0
            seq.status = SequenceStatus.PREEMPTED
            bisect.insort(self._waiting, seq, key=QUEUE_ORDER)
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
        self._kv = KvManager(
            cfg.num_blocks, cfg.block_size, cfg.num_cpu_blocks, cfg.enable_prefix_caching, previous=self._kv
        )
        outputs = []
        for request in list(self._requests.values()):
            try:
                self._check_fits(request.prompt_token_ids, request.sampling)
            except RequestRejected as exc:
                log.warning("request no longer fits the new executor", request_id=request.request_id, reason=str(exc))
                outputs.extend(self.abort(request.request_id, FinishReason.ERROR))
        log.info(
            "scheduler re-synced for a new executor", num_blocks=self.config.num_blocks, requeued=len(self._waiting)
        )
        return outputs
