"""Applying the executor's result for the plan in flight, and ending sequences.

`ResultApplier.apply` advances each scheduled sequence (`num_computed`, newly full blocks into
the prefix tree), appends its sampled token (or, after verifying drafts, its accepted drafts
and one more, rolling back the blocks that only rejected ones used), applies the stop rules
and the grammar, and emits one `SequenceOutput` per sampling sequence. `finish` ends a sequence in any state and returns
its blocks; the scheduler's abort paths use it too. It works on the `SchedulerState` the
`Scheduler` shares with its `StepBuilder`.
"""

from __future__ import annotations

import structlog

from kvserve.protos.step import SampledToken, StepResult
from kvserve.protos.stop_rules import FinishReason, stop_reason
from kvserve.scheduler.core.outputs import SampledLogprob, SequenceOutput
from kvserve.scheduler.core.request import WAITING_STATES, Sequence, SequenceStatus
from kvserve.scheduler.core.scheduler_state import ScheduledSequence, SchedulerState

log = structlog.get_logger(__name__)

_RUNNING = SequenceStatus.RUNNING
_FIRST_PAUSE, _LONGEST_PAUSE = 4, 64
"""Steps a sequence whose drafts keep failing stops proposing: doubled per failed probe, up to the longest."""


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
        if st.kv.disk is not None:
            disk = st.kv.disk
            disk.finish_loads(st.kv.tree, st.kv.pool, result.failed_load_blocks, result.disk_load_blocks)
            disk.drop_keys(result.dropped_keys)
        now = st.clock()
        if inflight.num_drafts:
            by_seq: dict[int, list[SampledToken]] = {}
            for out in result.outputs:
                by_seq.setdefault(out.seq_id, []).append(out)
            get_sampled = by_seq.get
        else:
            get_sampled = {out.seq_id: [out] for out in result.outputs}.get
        add_output = outputs.append
        bs, kv, eos, max_model_len = st.block_size, st.kv, st.eos, st.config.max_model_len
        caching = kv.caching
        any_finished = False
        for scheduled in inflight.scheduled:
            seq = scheduled.seq
            if seq.status is not _RUNNING:
                continue  # aborted or finished while the step ran: its token is ignored
            if not scheduled.samples:
                computed = seq.num_computed + scheduled.num_tokens
                seq.num_computed = computed
                if computed // bs > seq.num_tree_blocks and caching and not seq.cache_frozen:
                    kv.cache_full_blocks(seq)
                continue
            request = seq.request
            drafts = scheduled.drafts
            sampled_tokens = get_sampled(seq.seq_id)
            if sampled_tokens is None or not _verified(sampled_tokens, drafts):
                log.error(
                    "executor returned no token, or tokens that are not a verification of the drafts",
                    seq_id=seq.seq_id,
                    request_id=request.request_id,
                    returned=None if sampled_tokens is None else [t.token_id for t in sampled_tokens],
                    drafts=drafts,
                )
                seq.num_computed += 1 if drafts is None else scheduled.num_tokens - len(drafts)
                self.finish(seq, FinishReason.ERROR, remove=False)
                any_finished = True
                add_output(self.output(seq, [], None, FinishReason.ERROR))
                continue
            tokens = seq.token_ids
            new_tokens: list[int] = []
            logprobs: list[SampledLogprob] | None = [] if request.sampling.logprobs is not None else None
            reason = None
            error = None
            for sampled in sampled_tokens:
                token = sampled.token_id
                tokens.append(token)
                new_tokens.append(token)
                num_output = len(tokens) - seq.prompt_len
                if token in request.stop_ids or num_output >= request.max_output_tokens:
                    reason = stop_reason(request.sampling, token, num_output, len(tokens), eos, max_model_len)
                if seq.matcher is not None and reason is None:
                    reason = _advance_matcher(seq, token)
                    if reason is FinishReason.INTERNAL:
                        error = f"the executor sampled a token the grammar forbids (token id {token})"
                if logprobs is not None:
                    logprob = sampled.logprob if sampled.logprob is not None else float("nan")
                    logprobs.append(SampledLogprob(token, logprob, list(sampled.top_logprobs)))
                if reason is not None:
                    break
            # KV is kept for the last known token and every accepted draft: all tokens but the newest.
            computed = len(tokens) - 1
            seq.num_computed = computed
            if computed // bs > seq.num_tree_blocks and caching and not seq.cache_frozen:
                kv.cache_full_blocks(seq)
            if drafts is not None:
                self._settle_drafts(seq, drafts, len(new_tokens) - 1, reason is not None)
            if request.ttft_s is None:
                request.ttft_s = now - request.arrival_time
            if not request.prompt_done and seq.index == 0:
                request.prompt_done = True
            if reason is not None:
                self.finish(seq, reason, remove=False)
                any_finished = True
            add_output(
                SequenceOutput(
                    request_id=request.request_id,
                    index=seq.index,
                    new_token_ids=new_tokens,
                    logprobs=logprobs,
                    finish_reason=reason,
                    num_prompt_tokens=seq.prompt_len,
                    num_cached_tokens=request.num_cached_tokens,
                    num_output_tokens=len(tokens) - seq.prompt_len,
                    queue_time_s=request.queue_time_s,
                    ttft_s=request.ttft_s,
                    blocks=request.blocks,
                    num_host_cached_tokens=request.num_host_cached_tokens,
                    num_disk_cached_tokens=request.num_disk_cached_tokens,
                    drafts=request.drafts if st.proposer is not None else None,
                    error=error,
                )
            )
        if any_finished:
            st.running = [s for s in st.running if s.status is _RUNNING]
        if result.proposals:
            self._keep_proposals(inflight.scheduled, result.proposals)
        return outputs

    def _keep_proposals(self, scheduled: list[ScheduledSequence], proposals: list[tuple[int, list[int]]]) -> None:
        """The draft model's proposals for the next step, kept on the sequences still running."""
        running = {s.seq.seq_id: s.seq for s in scheduled if s.seq.status is _RUNNING}
        for seq_id, tokens in proposals:
            seq = running.get(seq_id)
            if seq is not None:
                seq.executor_drafts = tokens

    def _settle_drafts(self, seq: Sequence, drafts: list[int], accepted: int, finishing: bool) -> None:
        """Count a verification, adapt the sequence's proposing, and give back blocks only rejected drafts used."""
        st = self.state
        cfg = st.config
        counts = seq.request.drafts
        counts.proposed += len(drafts)
        counts.accepted += accepted
        counts.verify_steps += 1
        st.num_drafts_proposed += len(drafts)
        st.num_drafts_accepted += accepted
        st.num_verify_steps += 1
        seq.draft_rate = 0.5 * seq.draft_rate + 0.5 * (accepted / len(drafts))
        if seq.draft_rate < cfg.speculative_min_acceptance:
            seq.draft_pause_len = min(2 * seq.draft_pause_len or _FIRST_PAUSE, _LONGEST_PAUSE)
            seq.draft_pause = seq.draft_pause_len
            seq.draft_rate = cfg.speculative_min_acceptance  # one good probe resumes it
        elif accepted:
            seq.draft_pause_len = 0
        if finishing:
            return  # finish() releases the whole table
        table = seq.block_table
        keep = -(-len(seq.token_ids) // st.block_size)
        if keep >= len(table):
            return
        cut = table[keep:]
        del table[keep:]
        pool = st.kv.pool
        pool.release_table(cut)
        seq.request.blocks.freed += len(cut)
        if seq.request.reserve_blocks:
            pool.reserve(len(cut))  # back into its reservation, which the table may grow into again
            seq.reserved_blocks += len(cut)
        if seq.sent_blocks > keep:
            seq.sent_blocks = keep
            st.pending_trims.append((seq.seq_id, keep))

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
            num_host_cached_tokens=request.num_host_cached_tokens,
            num_disk_cached_tokens=request.num_disk_cached_tokens,
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
        if st.proposer is not None:
            st.proposer.finished(seq)
        request = seq.request
        if seq.index == 0:
            request.prompt_done = True  # completions waiting to fork from it fall back to a prefix match
        request.num_unfinished -= 1
        if request.num_unfinished == 0:
            del st.requests[request.request_id]


def _verified(sampled: list[SampledToken], drafts: list[int] | None) -> bool:
    """The executor's tokens are a verification of `drafts`: the accepted drafts, then one more."""
    if drafts is None:
        return len(sampled) == 1
    accepted = len(sampled) - 1
    return 0 <= accepted <= len(drafts) and all(t.token_id == d for t, d in zip(sampled[:accepted], drafts))


def _advance_matcher(seq: Sequence, token: int) -> FinishReason | None:
    """Feed a constrained completion's token to its grammar: GRAMMAR once it admits nothing more,
    INTERNAL for a token it forbids."""
    matcher = seq.matcher
    assert matcher is not None
    if not matcher.accept(token):
        # The plan's mask forbade it: an executor that ignored the mask, never a client error.
        log.error(
            "executor sampled a token the grammar forbids",
            request_id=seq.request.request_id,
            index=seq.index,
            seq_id=seq.seq_id,
            token_id=token,
            output_position=len(seq.token_ids) - 1 - seq.prompt_len,
        )
        return FinishReason.INTERNAL
    return FinishReason.GRAMMAR if matcher.is_finished else None
