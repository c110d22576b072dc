"""Applying the executor's result for the plan in flight, and ending sequences.

`ResultApplier.apply` advances each scheduled sequence (`num_computed`, newly full blocks into
the prefix tree), appends its sampled token, applies the stop rules and the grammar, and emits
one `SequenceOutput` per sampling sequence. `finish` ends a sequence in any state and returns
its blocks; the scheduler's abort paths use it too. It works on the `SchedulerState` the
`Scheduler` shares with its `StepBuilder`.
"""

from __future__ import annotations

import structlog

from kvserve.protos.step import StepResult
from kvserve.protos.stop_rules import FinishReason, stop_reason
from kvserve.scheduler.core.outputs import SampledLogprob, SequenceOutput
from kvserve.scheduler.core.request import WAITING_STATES, Sequence, SequenceStatus
from kvserve.scheduler.core.scheduler_state import SchedulerState

log = structlog.get_logger(__name__)

_RUNNING = SequenceStatus.RUNNING


class ResultApplier:
    def __init__(self, state: SchedulerState) -> None:
        self.state = state

    def apply(self, result: StepResult) -> list[SequenceOutput]:
        """The outputs of the plan in flight; [] for a result of any other step (a late one, or none in flight)."""
        st = self.state
        inflight = st.inflight
        if inflight is None or result.step_id != inflight.step_id:
            log.warning(
                "ignoring a result for a step not in flight",
                step_id=result.step_id,
                in_flight=inflight.step_id if inflight else None,
            )
            return []
        outputs: list[SequenceOutput] = []
        st.inflight = None
        st.num_steps += 1
        now = st.clock()
        get_sampled = {out.seq_id: out for out in result.outputs}.get
        add_output = outputs.append
        bs, kv, eos, max_model_len = st.block_size, st.kv, st.eos, st.config.max_model_len
        caching = kv.caching
        any_finished = False
        for scheduled in inflight.scheduled:
            seq = scheduled.seq
            if seq.status is not _RUNNING:
                continue  # aborted or finished while the step ran: its token is ignored
            computed = seq.num_computed + scheduled.num_tokens
            seq.num_computed = computed
            if computed // bs > seq.num_tree_blocks and caching and not seq.cache_frozen:
                kv.cache_full_blocks(seq)
            if not scheduled.samples:
                continue
            request = seq.request
            sampled = get_sampled(seq.seq_id)
            if sampled is None:
                log.error(
                    "executor returned no token for a sampling sequence",
                    seq_id=seq.seq_id,
                    request_id=request.request_id,
                )
                self.finish(seq, FinishReason.ERROR, remove=False)
                any_finished = True
                add_output(self.output(seq, [], None, FinishReason.ERROR))
                continue
            token = sampled.token_id
            tokens = seq.token_ids
            tokens.append(token)
            num_output = len(tokens) - seq.prompt_len
            reason = None
            if token in request.stop_ids or num_output >= request.max_output_tokens:
                reason = stop_reason(request.sampling, token, num_output, len(tokens), eos, max_model_len)
            if seq.matcher is not None and reason is None:
                reason = _advance_matcher(seq, token)
            if request.ttft_s is None:
                request.ttft_s = now - request.arrival_time
            if not request.prompt_done and seq.index == 0:
                request.prompt_done = True
            logprobs = None
            if request.sampling.logprobs is not None:
                logprob = sampled.logprob if sampled.logprob is not None else float("nan")
                logprobs = [SampledLogprob(token, logprob, list(sampled.top_logprobs))]
            if reason is not None:
                self.finish(seq, reason, remove=False)
                any_finished = True
            add_output(
                SequenceOutput(
                    request_id=request.request_id,
                    index=seq.index,
                    new_token_ids=[token],
                    logprobs=logprobs,
                    finish_reason=reason,
                    num_prompt_tokens=seq.prompt_len,
                    num_cached_tokens=request.num_cached_tokens,
                    num_output_tokens=num_output,
                    queue_time_s=request.queue_time_s,
                    ttft_s=request.ttft_s,
                    blocks=request.blocks,
                )
            )
        if any_finished:
            st.running = [s for s in st.running if s.status is _RUNNING]
        return outputs

    def output(
        self, seq: Sequence, tokens: list[int], logprobs: list[SampledLogprob] | None, reason: FinishReason | None
    ) -> SequenceOutput:
        """An output outside the `apply` fast path (abort, finish, errors)."""
        request = seq.request
        if logprobs is None and request.sampling.logprobs is not None:
            logprobs = []
        return SequenceOutput(
            request_id=request.request_id,
            index=seq.index,
            new_token_ids=tokens,
            logprobs=logprobs,
            finish_reason=reason,
            num_prompt_tokens=seq.prompt_len,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(seq.token_ids) - seq.prompt_len,
            queue_time_s=request.queue_time_s,
            ttft_s=request.ttft_s,
            blocks=request.blocks,
        )

    def finish(self, seq: Sequence, reason: FinishReason, *, remove: bool = True) -> None:
        """End one sequence in any state and return all its blocks. `remove=False`: the caller prunes `running`."""
        st = self.state
        status = seq.status
        if status is _RUNNING:
            if remove:
                st.running.remove(seq)
        elif status in WAITING_STATES:
            st.waiting.remove(seq)
        elif status is SequenceStatus.SWAPPED:
            st.swapped.remove(seq)
            st.kv.release_swapped(seq)
        st.kv.release(seq)
        if seq.known:
            st.pending_drops.append(seq.seq_id)
            seq.known = False
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        request = seq.request
        if seq.index == 0:
            request.prompt_done = True  # completions waiting to fork from it fall back to a prefix match
        request.num_unfinished -= 1
        if request.num_unfinished == 0:
            del st.requests[request.request_id]


def _advance_matcher(seq: Sequence, token: int) -> FinishReason | None:
    """Feed a constrained completion's token to its grammar: GRAMMAR once it admits nothing more."""
    matcher = seq.matcher
    assert matcher is not None
    if not matcher.accept(token):
        # The plan's mask forbade it: an executor that ignored the mask, never a client error.
        log.error("executor sampled a token the grammar forbids", seq_id=seq.seq_id, token_id=token)
        return FinishReason.ERROR
    return FinishReason.GRAMMAR if matcher.is_finished else None
