"""The continuous-batching scheduler: the core's one entry point, read top to bottom.

`Scheduler` owns one `SchedulerState` and two workers on it: a `StepBuilder` turns the queues
into the next `StepPlan` (`schedule`), and a `ResultApplier` applies the executor's answer
(`update`) and ends sequences (`abort`, `finish_sequence`, `fail_all`). The scheduler itself
queues requests (`add_request`: it asserts what the API edge validated and refuses only what
can never fit), re-syncs a replaced executor (`reset_executor`) and offers the read-only
`view()` and `stats()` that invariants, dumps and tests use.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceOf

import structlog

from kvserve.protos.kv_events import MEDIUM_DISK
from kvserve.protos.sampling import InvalidFieldError, SamplingParams
from kvserve.protos.step import StepPlan, StepResult
from kvserve.protos.stop_rules import FinishReason, stop_token_ids
from kvserve.scheduler.core import invariants
from kvserve.scheduler.core.admission import check_fits
from kvserve.scheduler.core.disk_tier import DiskTier
from kvserve.scheduler.core.draft_proposer import DraftProposer, proposer_for
from kvserve.scheduler.core.kv_manager import KvManager
from kvserve.scheduler.core.outputs import SchedulerStats, SequenceOutput
from kvserve.scheduler.core.prefix_tree import PrefixTreeListener
from kvserve.scheduler.core.request import (
    QUEUE_ORDER,
    Request,
    RequestRejected,
    Sequence,
    SequenceStatus,
    derive_seed,
    resolve_seed,
)
from kvserve.scheduler.core.scheduler_config import SchedulerConfig
from kvserve.scheduler.core.scheduler_state import SchedulerState
from kvserve.scheduler.core.scheduler_view import SchedulerView, stats_of, view_of
from kvserve.scheduler.core.step_builder import StepBuilder
from kvserve.scheduler.core.step_results import ResultApplier
from kvserve.scheduler.core.token_matcher import MatcherFactory

log = structlog.get_logger(__name__)


def _sampling_problem(sampling: SamplingParams) -> str | None:
    """Why `sampling` is out of range (None: it is not). Only evaluated inside `assert`."""
    try:
        sampling.validate()
    except InvalidFieldError as exc:
        return str(exc)
    return None


class Scheduler:
    """Owns every request, the block pool and the prefix tree; one plan in flight at a time."""

    def __init__(
        self,
        config: SchedulerConfig,
        clock: Callable[[], float] = time.monotonic,
        proposer: DraftProposer | None = None,
    ) -> None:
        """`proposer`: draft tokens for speculative decoding; None: the one `config.speculative` names."""
        self.config = config
        self._state = SchedulerState.fresh(config, clock, proposer or proposer_for(config))
        self._steps = StepBuilder(self._state)
        self._results = ResultApplier(self._state)

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
        lora_name: str = "",
    ) -> None:
        """Queue a request; raise RequestRejected if it could never fit the KV capacity.

        Lower `priority` is served first; FCFS within a priority. Requests in different
        `namespace`s never share KV blocks. The caller has validated the request (see
        `kvserve.scheduler.server.intake.request_parsing`): a reused id, an empty prompt, a negative
        token id or out-of-range sampling fail an assertion here, not a validation.
        A `constraint` (structured output) gives each completion its own matcher. A `lora_name`
        (one the executor reported) runs it under that LoRA adapter; its `namespace` must be the
        adapter's own, since the same tokens under two adapters have different KV.
        """
        st = self._state
        assert request_id not in st.requests, f"request id {request_id!r} is still in progress"
        prompt = list(prompt_token_ids)
        assert prompt and min(prompt) >= 0, "the prompt must be non-empty, non-negative token ids"
        assert (problem := _sampling_problem(sampling)) is None, problem
        check_fits(self.config, st.kv.pool.num_blocks, len(prompt), sampling)
        arrival = st.clock() if arrival_time is None else arrival_time
        seed = resolve_seed(sampling.seed)
        request = Request(request_id, prompt, sampling, priority, namespace, arrival, st.next_order, seed)
        request.lora_name = lora_name
        request.stop_ids = stop_token_ids(sampling, st.eos)
        request.max_output_tokens = min(sampling.max_tokens, self.config.max_model_len - len(prompt))
        request.reserve_blocks = self.config.reserved_blocks(len(prompt), sampling.max_tokens)
        st.next_order += 1
        for index in range(sampling.n):
            st.next_seq_id += 1
            seq = Sequence(
                seq_id=st.next_seq_id,
                request=request,
                index=index,
                token_ids=list(prompt),
                prompt_len=len(prompt),
                seed=derive_seed(seed, index),
                sort_key=(priority, arrival, request.order, index),
            )
            if constraint is not None:
                seq.matcher = constraint.new_matcher()
            request.seqs.append(seq)
            bisect.insort(st.waiting, seq, key=QUEUE_ORDER)
        request.num_unfinished = sampling.n
        st.requests[request_id] = request

    def has_unfinished(self) -> bool:
        """Requests in flight, or blocks the disk tier has yet to write (a plan of their own when idle)."""
        disk = self._state.kv.disk
        return bool(self._state.requests) or (disk is not None and disk.has_stores)

    # --- one step --------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Build the next plan. An empty plan (`plan.is_empty`) needs no executor step or update()."""
        if self._state.inflight is not None:
            raise RuntimeError(f"step {self._state.inflight.step_id} is still in flight: call update() first")
        plan = self._steps.build()
        if self.config.debug_invariants:
            self.check_invariants()
        return plan

    def update(self, result: StepResult) -> list[SequenceOutput]:
        """Apply the executor's result for the last plan: advance, append tokens, stop, emit outputs."""
        outputs = self._results.apply(result)
        if self.config.debug_invariants:
            self.check_invariants()
        return outputs

    # --- ending sequences ------------------------------------------------------------

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> list[SequenceOutput]:
        """End a request in any state; one final output per unfinished completion ([] if unknown)."""
        request = self._state.requests.get(request_id)
        if request is None:
            return []
        outputs = []
        for seq in request.seqs:
            if not seq.is_finished:
                self._results.finish(seq, reason)
                outputs.append(self._results.output(seq, [], None, reason))
        return outputs

    def finish_sequence(
        self, request_id: str, index: int, reason: FinishReason = FinishReason.STOP
    ) -> SequenceOutput | None:
        """Stop-string hook: end completion `index` now (None if unknown or already finished)."""
        request = self._state.requests.get(request_id)
        if request is None or not 0 <= index < len(request.seqs) or request.seqs[index].is_finished:
            return None
        seq = request.seqs[index]
        self._results.finish(seq, reason)
        return self._results.output(seq, [], None, reason)

    def fail_all(self, reason: FinishReason = FinishReason.ERROR) -> list[SequenceOutput]:
        """End every request (no executor came back in time) and return every block."""
        outputs = []
        for request_id in list(self._state.requests):
            outputs.extend(self.abort(request_id, reason))
        self._state.inflight = None
        return outputs

    def set_disk_tier(
        self, fingerprint: str, keys: Iterable[int], media: Iterable[str] = (MEDIUM_DISK,), block_bytes: int = 0
    ) -> None:
        """Use the executor's tiers below the pool: `fingerprint`, `keys`, `media` and `block_bytes` are its
        `ExecutorInfo.kv_fingerprint`, `kv_disk_keys`, `kv_tiers` and `kv_block_bytes` ("" turns the tiers
        off). Call it after construction and after `reset_executor`."""
        kv = self._state.kv
        old = kv.disk
        kv.disk = DiskTier(fingerprint, keys, kv.block_size, media, block_bytes) if fingerprint and kv.caching else None
        if kv.disk is not None:
            kv.disk.listener = kv.tree.listener
            if old is not None:
                kv.disk.carry_counters(old)

    def reset_executor(self, num_blocks: int | None = None) -> list[SequenceOutput]:
        """The executor was replaced and its KV is gone: requeue every sequence for recompute.

        Generated tokens are kept; the plan in flight (if any) is void. Requests that no
        longer fit a smaller pool are finished with ERROR: their final outputs are returned.
        """
        st = self._state
        st.inflight = None
        if st.kv.disk is not None:
            st.kv.disk.drop_in_flight()  # references and blocks that die with the old pool
        for seq in st.running + st.swapped:
            seq.request.blocks.freed += len(seq.block_table)  # references dropped with the old pool
            seq.cpu_table = []
            seq.block_table = []
            seq.reserved_blocks = 0
            seq.status = SequenceStatus.PREEMPTED
            bisect.insort(st.waiting, seq, key=QUEUE_ORDER)
        for seq in st.waiting:
            seq.num_computed = 0
            seq.known = False
            seq.sent_tokens = seq.sent_blocks = 0
            seq.tree_node, seq.num_tree_blocks, seq.cache_frozen = None, 0, False
        st.running, st.swapped = [], []
        st.pending_drops = []
        st.pending_trims = []
        if num_blocks is not None:
            self.config.num_blocks = num_blocks
        cfg = self.config
        old_disk = st.kv.disk
        st.kv = KvManager(cfg.num_blocks, cfg.block_size, cfg.num_cpu_blocks, cfg.enable_prefix_caching, previous=st.kv)
        if old_disk is not None:  # the files outlive the executor's pool (a new executor reports its own)
            self.set_disk_tier(old_disk.fingerprint, old_disk.on_disk, old_disk.media, old_disk.block_bytes)
            assert st.kv.disk is not None
            st.kv.disk.carry_counters(old_disk)
        outputs = []
        for request in list(st.requests.values()):
            try:
                check_fits(cfg, st.kv.pool.num_blocks, len(request.prompt_token_ids), request.sampling)
            except RequestRejected as exc:
                log.warning("request no longer fits the new executor", request_id=request.request_id, reason=str(exc))
                outputs.extend(self.abort(request.request_id, FinishReason.ERROR))
        log.info("scheduler re-synced for a new executor", num_blocks=cfg.num_blocks, requeued=len(st.waiting))
        return outputs

    # --- read-only -------------------------------------------------------------------

    def set_prefix_listener(self, listener: PrefixTreeListener | None) -> None:
        """Hear every change to the prefix tree from now on, across executor resets too."""
        self._state.kv.tree.listener = listener
        if self._state.kv.disk is not None:
            self._state.kv.disk.listener = listener

    def view(self) -> SchedulerView:
        """A snapshot of the queues and requests, with the live pool and tree (O(sequences + requests))."""
        return view_of(self._state)

    def stats(self) -> SchedulerStats:
        return stats_of(self._state)

    def request(self, request_id: str) -> Request | None:
        """An unfinished request, or None (for the API layer and tests; read it, never change it)."""
        return self._state.requests.get(request_id)

    def ref_count(self, block_id: int) -> int:
        """How many live block tables hold device block `block_id` (for tests and debugging)."""
        return self._state.kv.pool.ref_counts[block_id]

    def check_invariants(self) -> None:
        """Raise InvariantError (an AssertionError) naming the first broken KV/queue invariant."""
        invariants.check(self.view())

    def debug_dump(self) -> str:
        """Every live sequence's block table with ref counts, plus pool and tree summaries."""
        return invariants.dump(self.view())
