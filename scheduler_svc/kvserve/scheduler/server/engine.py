"""The engine loop: the one coroutine that owns the `Scheduler` and drives the executor.

Each turn: apply what was posted since the last step boundary (aborts, stop-string
finishes), build a plan, send it over the link, apply the result. API handlers never
touch the scheduler during a step: they add requests (queued until the next plan) and
post aborts, which the loop applies before its next plan, so a cancel takes effect
within one step.

Overlap: each step's outputs become text (request_delivery: detokenizer, stop strings,
chunks) *after* the next plan has been sent, while the executor computes it. A completed
stop string ends its completion's stream chunk at once but, like an abort, reaches the
scheduler only at the next boundary; the token sampled for it meanwhile is ignored.

Executor loss is survived: the engine reports LOST, waits for a new executor to
handshake, gives it the LoRA adapters requests run under (`on_new_executor`: the adapter
catalog's restore), re-syncs the scheduler (everything recomputed) and carries on. If none
comes back within `executor_restart_timeout_s`, every request ends with UNAVAILABLE.

The queue limits a submitted request meets are `queue_admission.QueueAdmission`; the states and
counters the APIs report are `engine_status`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from kvserve.protos.sampling import InvalidFieldError
from kvserve.protos.step import ExecutorInfo, StepPlan
from kvserve.protos.stop_rules import FinishReason
from kvserve.scheduler.core import MatcherFactory, Scheduler, SchedulerView, SequenceOutput
from kvserve.scheduler.server.delivery.request_delivery import ActiveRequest
from kvserve.scheduler.server.delivery.request_stream import FailureKind, RequestFailed, RequestStream
from kvserve.scheduler.server.engine_status import EngineStats, ExecutorState
from kvserve.scheduler.server.executor_link.connection import ExecutorLink
from kvserve.scheduler.server.executor_link.link_errors import ExecutorLost, ExecutorStepError
from kvserve.scheduler.server.intake.request_parsing import ValidatedRequest
from kvserve.scheduler.server.intake.served_models import ModelNotFound
from kvserve.scheduler.server.intake.tokenizer import Tokenizer
from kvserve.scheduler.server.observability.kv_event_publisher import KvEventPublisher
from kvserve.scheduler.server.observability.metrics import ServerMetrics
from kvserve.scheduler.server.observability.step_history import StepHistory, step_composition
from kvserve.scheduler.server.queue_admission import QueueAdmission
from kvserve.scheduler.server.security.namespaces import NamespaceOwners, tenant_of_scoped_id
from kvserve.scheduler.server.server_config import ServerConfig

log = structlog.get_logger(__name__)

_PROMPT_CONTEXT_TOKENS = 4
"""Prompt tokens given to each detokenizer as context, so the first output token decodes as in the full text."""
_EXECUTOR_POLL_S = 0.1
"""While waiting for an executor, posted aborts and stop-string finishes are still applied this often."""


class Engine:
    """Owns the Scheduler; API handlers call `submit`/`abort`, `run` is the loop."""

    def __init__(
        self,
        scheduler: Scheduler,
        link: ExecutorLink,
        tokenizer: Tokenizer,
        config: ServerConfig,
        *,
        on_state_change: Callable[[ExecutorState], None] | None = None,
        metrics: ServerMetrics | None = None,
        kv_events: KvEventPublisher | None = None,
        on_new_executor: Callable[[ExecutorInfo], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`on_new_executor(info)` runs before the scheduler re-syncs with a newly registered executor;
        ExecutorLost from it means that one is gone too."""
        self._scheduler = scheduler
        self._link = link
        self._tokenizer = tokenizer
        self._config = config
        self._on_state_change = on_state_change
        self._metrics = metrics
        self._kv_events = kv_events
        """Publishes the prefix tree's changes once per step (and after a re-sync)."""
        self._on_new_executor = on_new_executor
        self._clock = clock
        self._requests: dict[str, ActiveRequest] = {}
        self._pending_aborts: set[str] = set()
        self._pending_finishes: set[tuple[str, int]] = set()
        """(request id, completion index) whose stop string completed; the scheduler hears at the next boundary."""
        self._deferred: list[SequenceOutput] = []
        """The last step's outputs, streamed while the executor computes the next step (see `run`)."""
        self._wakeup = asyncio.Event()
        self._queue = QueueAdmission(config.max_queued_requests, config.max_queued_prompt_tokens)
        self._steps = 0
        self._stopping = False
        self._draining = False
        self._unavailable_reason: str | None = None
        self._synced_generation = link.generation
        self.history = StepHistory()
        """The last steps and minutes, for the engine view."""
        self.namespace_owners = NamespaceOwners()
        """Which tenant each prefix namespace belongs to, for the engine view's tenancy."""
        self.loras: dict[str, int] = {}
        """The LoRA adapters a request may run under now (name -> id), kept by the adapter catalog: a
        request parsed under an adapter unloaded (or replaced) since is refused here, before its plan."""
        self.state = ExecutorState.READY if link.connected else ExecutorState.LOST
        if metrics is not None:
            metrics.set_executor_up(self.state is ExecutorState.READY)

    # --- API side -------------------------------------------------------------------

    def submit(
        self,
        request: ValidatedRequest,
        namespace: str,
        constraint: MatcherFactory | None = None,
        *,
        internal: bool = False,
    ) -> RequestStream:
        """Queue a parsed request, with its compiled structured-output `constraint` if any. An `internal`
        request is the server's own (the readiness probe): it stays out of the request metrics, which
        count what clients were served.

        Raise InvalidFieldError (id in flight), RequestRejected (can never fit, from the
        scheduler, which alone knows its capacity) or RequestFailed (busy or down)."""
        if self._draining or self._stopping:
            raise RequestFailed(FailureKind.UNAVAILABLE, "the server is shutting down")
        if self._unavailable_reason is not None:
            raise RequestFailed(FailureKind.UNAVAILABLE, self._unavailable_reason)
        # In flight until its stream closes, which is never before the scheduler has let go of it.
        if request.request_id in self._requests:
            raise InvalidFieldError("request_id", "a request with this id is already in flight")
        if request.lora_name and self.loras.get(request.lora_name) != request.lora_id:
            raise ModelNotFound(request.lora_name, self.loras)
        num_prompt = len(request.prompt_token_ids)
        self._queue.check_room(num_prompt)
        arrival = self._clock()
        self.namespace_owners.note(namespace, tenant_of_scoped_id(request.request_id))
        self._scheduler.add_request(
            request.request_id,
            request.prompt_token_ids,
            request.sampling,
            priority=request.priority,
            namespace=namespace,
            arrival_time=arrival,
            constraint=constraint,
            lora_name=request.lora_name,
        )
        metrics = None if internal else self._metrics
        if metrics is not None and request.lora_name:
            metrics.inc_lora_requests(request.lora_name)
        context = list(request.prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        stream = RequestStream(request.request_id, self._config.stream_buffer_chunks)
        self._requests[request.request_id] = ActiveRequest.create(
            request, stream, self._tokenizer, context, arrival, self._clock, metrics
        )
        self._queue.enter(num_prompt)
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> bool:
        """Abort at the next step boundary; False if no such request is in flight."""
        if request_id not in self._requests:
            return False
        self._pending_aborts.add(request_id)
        self._wakeup.set()
        return True

    def view(self) -> SchedulerView:
        """The scheduler's read-only view; only for use on the loop, between its awaits."""
        return self._scheduler.view()

    def stats(self) -> EngineStats:
        return EngineStats(
            scheduler=self._scheduler.stats(),
            executor_state=self.state,
            steps=self._steps,
            active_requests=len(self._requests),
        )

    @property
    def num_active(self) -> int:
        return len(self._requests)

    def requests_under(self, lora_name: str) -> int:
        """How many requests in flight (queued or running) run under the LoRA adapter `lora_name`."""
        return sum(1 for active in self._requests.values() if active.lora_name == lora_name)

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests, let in-flight ones finish for up to `grace_s`, then abort the rest."""
        self._draining = True
        deadline = self._clock() + grace_s
        while self._requests and self._clock() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._requests):
            self.abort(request_id)
        while self._requests and self._pending_aborts:
            await asyncio.sleep(0.01)
        self.stop()

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()

    def on_link_change(self, connected: bool) -> None:
        """Link callback: report a loss at once (health), and wake the loop to re-sync a newcomer."""
        if not connected:
            self._set_state(ExecutorState.LOST)
        self._wakeup.set()

    # --- the loop --------------------------------------------------------------------

    async def run(self) -> None:
        while not self._stopping:
            self._apply_posted()
            if self._link.connected and self._link.generation != self._synced_generation:
                info = self._link.info
                assert info is not None  # connected: a registered executor's handshake info
                await self._adopt(info)  # replaced between steps: its KV (and prefix cache) is gone
                continue
            if not self._scheduler.has_unfinished():
                self._wakeup.clear()
                self._flush_deferred()
                if not self._pending_aborts and not self._pending_finishes and not self._stopping:
                    await self._wakeup.wait()
                continue
            plan = self._scheduler.schedule()
            if plan.is_empty:
                # Nothing can run right now (the scheduler waits on memory); don't spin.
                self._wakeup.clear()
                self._flush_deferred()  # a stop string completing here sets the wakeup
                try:
                    await asyncio.wait_for(self._wakeup.wait(), 0.005)
                except TimeoutError:
                    pass
                continue
            started = self._clock()
            step = asyncio.ensure_future(self._link.step(plan))
            if self._deferred:
                await asyncio.sleep(0)  # let the step task send the plan first...
                self._flush_deferred()  # ...then detokenize and stream the last step's tokens meanwhile
            try:
                result = await step
            except ExecutorLost as exc:
                await self._recover_executor(str(exc))
                continue
            except ExecutorStepError as exc:
                await self._recover_step_error(str(exc))
                continue
            self._steps += 1
            outputs = self._scheduler.update(result)
            self._deferred.extend(outputs)
            self._observe_step(plan, outputs, self._clock() - started)
        self._flush_deferred()
        self._fail_everything(FailureKind.UNAVAILABLE, "the server is shutting down")

    def _flush_deferred(self) -> None:
        if self._deferred:
            deferred, self._deferred = self._deferred, []
            self._deliver(deferred)

    def _apply_posted(self) -> None:
        """The step boundary: stop-string finishes (so the scheduler records STOP), then aborts."""
        self._apply_finishes()
        self._apply_aborts()

    def _apply_finishes(self) -> None:
        """Let the scheduler go of sequences whose stop string completed; close requests with nothing left."""
        finishes, self._pending_finishes = self._pending_finishes, set()
        for request_id, index in finishes:
            self._scheduler.finish_sequence(request_id, index, FinishReason.STOP)
        for request_id in {request_id for request_id, _ in finishes}:
            active = self._requests.get(request_id)
            if active is not None:
                active.stop_pending = False
                if active.all_finished:
                    self._finish_request(active, FinishReason.STOP)

    def _apply_aborts(self) -> None:
        while self._pending_aborts:
            request_id = self._pending_aborts.pop()
            self._deliver(self._scheduler.abort(request_id))
            active = self._requests.get(request_id)
            if active is not None:  # the scheduler had already let go of it: close here
                self._finish_request(active, FinishReason.ABORT)

    def _deliver(self, outputs: list[SequenceOutput]) -> None:
        for output in outputs:
            active = self._requests.get(output.request_id)
            if active is None or not active.accepts(output.index):
                continue
            if not active.started:
                active.started = True
                self._queue.leave(active.num_prompt_tokens)
            if active.deliver(output):
                self._pending_finishes.add((active.request_id, output.index))
                active.stop_pending = True
                self._wakeup.set()
            elif output.finish_reason is FinishReason.INTERNAL and not active.all_finished:
                self._pending_aborts.add(active.request_id)  # it failed: its other completions end too
                self._wakeup.set()
            if active.all_finished and not active.stop_pending:
                self._finish_request(active, output.finish_reason)

    def _finish_request(self, active: ActiveRequest, reason: FinishReason | None) -> None:
        """Forget the request, settle the queue counters, then close its stream and log it."""
        self._requests.pop(active.request_id, None)
        self._pending_aborts.discard(active.request_id)
        if not active.started:
            self._queue.leave(active.num_prompt_tokens)
        active.close(reason)

    def _fail_everything(self, kind: FailureKind, message: str) -> None:
        """End every request with an error status and return all their blocks."""
        self._scheduler.fail_all(FinishReason.ERROR)
        self._pending_aborts.clear()
        self._pending_finishes.clear()
        for active in list(self._requests.values()):
            active.stream.fail(RequestFailed(kind, message))
            self._finish_request(active, FinishReason.ERROR)

    # --- executor failures -----------------------------------------------------------

    def _observe_step(self, plan: StepPlan, outputs: list[SequenceOutput], duration_s: float) -> None:
        """The step's composition and the tokens that came back, into the step history, and the
        metrics when configured."""
        prompt_tokens, decode_rows = step_composition(plan)
        generated = sum(len(o.new_token_ids) for o in outputs if o.finish_reason is not FinishReason.ABORT)
        stats = self._scheduler.stats()
        self.history.record(prompt_tokens, decode_rows, generated, stats.prefix_queried_tokens, stats.prefix_hit_tokens)
        if self._metrics is not None:
            self._metrics.observe_step(duration_s, stats, prompt_tokens, generated)
        if self._kv_events is not None:
            self._kv_events.flush()

    def _set_state(self, state: ExecutorState) -> None:
        if state is not self.state:
            self.state = state
            log.info("executor_state", state=state.value)
            if self._metrics is not None:
                self._metrics.set_executor_up(state is ExecutorState.READY)
            if self._on_state_change is not None:
                self._on_state_change(state)

    async def _recover_executor(self, why: str) -> None:
        """Wait for a new executor; re-sync the scheduler; fail everything if none comes in time."""
        log.warning("executor_lost", error=why, active_requests=len(self._requests))
        self._set_state(ExecutorState.LOST)
        self._fail_repeat_victims(why)
        timeout = self._config.executor_restart_timeout_s
        deadline = self._clock() + timeout
        info: ExecutorInfo | None = None
        while not self._stopping:
            self._apply_posted()
            if self._unavailable_reason is None and self._clock() >= deadline:
                self._unavailable_reason = f"the executor was lost ({why}) and did not come back within {timeout:g} s"
                self._fail_everything(FailureKind.UNAVAILABLE, self._unavailable_reason)
            try:
                info = await self._link.wait_for_executor(timeout_s=_EXECUTOR_POLL_S)
                if self._link.connected:
                    break
            except TimeoutError:
                continue
        if info is not None:
            await self._adopt(info)

    async def _adopt(self, info: ExecutorInfo) -> None:
        """Make a newly registered executor current: its adapters first, then the re-sync. Lost meanwhile,
        it is not synced, and the loop meets the next registration (or the loss) on its next turn."""
        generation = self._link.generation
        if self._on_new_executor is not None:
            try:
                await self._on_new_executor(info)
            except ExecutorLost as exc:
                log.warning("executor_lost_while_restoring_adapters", error=str(exc))
                return
            if self._link.generation != generation:
                return  # replaced meanwhile: adopt that one instead
        self._fail_missing_adapters()
        self._resync(info)

    def _fail_missing_adapters(self) -> None:
        """End the requests whose LoRA adapter the new executor does not hold (one its --lora no longer
        gives, or whose files are gone): recomputed, they would fail every step they share."""
        for active in list(self._requests.values()):
            if active.lora_name and active.lora_name not in self.loras:
                message = (
                    f"the LoRA adapter {active.lora_name!r} is no longer loaded (the executor restarted without it)"
                )
                active.log.warning("request_failed_adapter_gone", lora_name=active.lora_name)
                self._scheduler.abort(active.request_id, FinishReason.ERROR)
                active.stream.fail(RequestFailed(FailureKind.UNAVAILABLE, message))
                self._finish_request(active, FinishReason.ERROR)

    def _fail_repeat_victims(self, why: str) -> None:
        """Count this loss against every request in flight; fail those that reached the limit.

        A request that crashes or hangs each executor it reaches would otherwise be
        recomputed forever and take every other request down with it each time.
        """
        limit = self._config.executor_losses_per_request
        for active in list(self._requests.values()):
            active.executor_losses += 1
            if active.executor_losses < limit:
                continue
            message = (
                f"the executor was lost {active.executor_losses} times while this request was in flight "
                f"(last: {why}); not retrying it"
            )
            active.log.warning("request_failed_after_executor_losses", losses=active.executor_losses)
            self._scheduler.abort(active.request_id, FinishReason.ERROR)
            active.stream.fail(RequestFailed(FailureKind.UNAVAILABLE, message))
            self._finish_request(active, FinishReason.ERROR)

    def _resync(self, info: ExecutorInfo) -> None:
        """A new executor holds nothing: recompute every sequence from the scheduler's state."""
        # Requests that no longer fit a smaller new pool come back as final ERROR outputs.
        self._deliver(self._scheduler.reset_executor(info.num_blocks))
        # What is on its disk now (its host memory starts empty).
        self._scheduler.set_disk_tier(info.kv_fingerprint, info.kv_disk_keys, info.kv_tiers, info.kv_block_bytes)
        self._synced_generation = self._link.generation
        self._unavailable_reason = None
        if self._kv_events is not None:
            self._kv_events.flush()  # AllBlocksCleared now, not at the next step
        if self._metrics is not None:
            self._metrics.inc_executor_restarts()
        log.info(
            "executor_resynced",
            num_blocks=info.num_blocks,
            generation=self._link.generation,
            active_requests=len(self._requests),
        )
        self._set_state(ExecutorState.READY)
        self._wakeup.set()

    async def _recover_step_error(self, why: str) -> None:
        """The executor failed a step but lives: fail the requests (retrying could repeat the crash) and re-sync."""
        log.error("executor_step_error", error=why, active_requests=len(self._requests))
        self._fail_everything(FailureKind.INTERNAL, f"the executor failed a step: {why}")
        try:
            await self._link.reset_executor()
        except ExecutorLost as exc:
            await self._recover_executor(str(exc))
            return
        self._deliver(self._scheduler.reset_executor())
        self._synced_generation = self._link.generation
