"""The engine loop: the one coroutine that owns the `Scheduler` and drives the executor.

Each turn: apply pending aborts, build a plan, send it over the link, apply the result,
then turn each sequence's new tokens into text (detokenizer + stop strings) and push
chunks to the request streams. API handlers never touch the scheduler during a step:
they add requests (queued until the next plan) and post aborts, which the loop applies
before its next plan, so a cancel takes effect within one step.

Overlap: text for requests without stop strings is produced *after* the next plan has
been sent, while the executor computes it. Requests with stop strings are handled before
the next plan, because a completed stop string must finish its sequence first.

Executor loss is survived: the engine reports LOST, waits for a new executor to
handshake, re-syncs the scheduler (everything recomputed) and carries on. If none comes
back within `executor_restart_timeout_s`, every request ends with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from protos.sampling import InvalidFieldError
from protos.step import ExecutorInfo, StepPlan
from scheduler_svc.server.detokenizer import CompletionText
from scheduler_svc.server.executor_link import ExecutorLink, ExecutorLost, ExecutorStepError
from scheduler_svc.server.metrics import ServerMetrics
from scheduler_svc.core.outputs import SchedulerStats, SequenceOutput
from protos.stop_rules import FinishReason
from scheduler_svc.server.request_stream import CompletionChunk, FailureKind, RequestFailed, RequestStream, Usage
from scheduler_svc.server.request_parsing import ValidatedRequest
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.server.server_config import ServerConfig
from scheduler_svc.server.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

_PROMPT_CONTEXT_TOKENS = 4
"""Prompt tokens given to each detokenizer as context, so the first output token decodes as in the full text."""
_EXECUTOR_POLL_S = 0.1
"""While waiting for an executor, aborts are still applied this often."""
_TOKEN_FINISHES = (FinishReason.STOP, FinishReason.EOS)


class ExecutorState(str, enum.Enum):
    WAITING = "waiting"
    READY = "ready"
    LOST = "lost"


@dataclass(slots=True)
class _Completion:
    text: CompletionText
    finished: bool = False
    last_token_time: float | None = None
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class _ActiveRequest:
    request_id: str
    stream: RequestStream
    completions: list[_Completion]
    num_prompt_tokens: int
    arrival: float
    log: structlog.typing.FilteringBoundLogger
    has_stop_strings: bool = False
    started: bool = False
    usage: list[Usage | None] = field(default_factory=list)
    executor_losses: int = 0
    """Executor losses this request lived through; past the limit it fails instead of recomputing."""


@dataclass(slots=True)
class EngineStats:
    scheduler: SchedulerStats
    executor_state: ExecutorState
    steps: int
    active_requests: int


class Engine:
    """Owns the Scheduler; API handlers call `submit`/`abort`, `run` is the loop."""

    def __init__(self, scheduler: Scheduler, link: ExecutorLink, tokenizer: Tokenizer, config: ServerConfig,
                 *, on_state_change: Callable[[ExecutorState], None] | None = None,
                 metrics: ServerMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._scheduler = scheduler
        self._link = link
        self._tokenizer = tokenizer
        self._config = config
        self._on_state_change = on_state_change
        self._metrics = metrics
        self._clock = clock
        self._requests: dict[str, _ActiveRequest] = {}
        self._pending_aborts: set[str] = set()
        self._deferred: list[SequenceOutput] = []
        """Outputs streamed while the executor computes the next step (see `run`)."""
        self._wakeup = asyncio.Event()
        self._queued_requests = 0
        self._queued_prompt_tokens = 0
        self._steps = 0
        self._stopping = False
        self._draining = False
        self._unavailable_reason: str | None = None
        self._synced_generation = link.generation
        self.state = ExecutorState.READY if link.connected else ExecutorState.LOST
        if metrics is not None:
            metrics.set_executor_up(self.state is ExecutorState.READY)

    # --- API side -------------------------------------------------------------------

    def submit(self, request: ValidatedRequest, namespace: str) -> RequestStream:
        """Queue a validated request; raises InvalidFieldError/RequestRejected (bad) or RequestFailed (busy/down)."""
        if self._draining or self._stopping:
            raise RequestFailed(FailureKind.UNAVAILABLE, "the server is shutting down")
        if self._unavailable_reason is not None:
            raise RequestFailed(FailureKind.UNAVAILABLE, self._unavailable_reason)
        if request.request_id in self._requests:
            raise InvalidFieldError("request_id", "a request with this id is already in flight")
        num_prompt = len(request.prompt_token_ids)
        if self._queued_requests >= self._config.max_queued_requests:
            raise RequestFailed(FailureKind.RESOURCE_EXHAUSTED,
                                f"queue full: {self._queued_requests} requests are waiting; retry later")
        if self._queued_prompt_tokens + num_prompt > self._config.max_queued_prompt_tokens:
            raise RequestFailed(FailureKind.RESOURCE_EXHAUSTED,
                                f"queue full: {self._queued_prompt_tokens} prompt tokens are waiting; retry later")
        arrival = self._clock()
        self._scheduler.add_request(request.request_id, request.prompt_token_ids, request.sampling,
                                    priority=request.priority, namespace=namespace, arrival_time=arrival)
        context = request.prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        completions = [_Completion(CompletionText(self._tokenizer, request.sampling.stop, context))
                       for _ in range(request.sampling.n)]
        stream = RequestStream(request.request_id, self._config.stream_buffer_chunks)
        self._requests[request.request_id] = _ActiveRequest(
            request_id=request.request_id, stream=stream, completions=completions, num_prompt_tokens=num_prompt,
            arrival=arrival, log=log.bind(request_id=request.request_id), usage=[None] * request.sampling.n,
            has_stop_strings=bool(request.sampling.stop))
        self._queued_requests += 1
        self._queued_prompt_tokens += num_prompt
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> bool:
        """Abort at the next step boundary; False if no such request is in flight."""
        if request_id not in self._requests:
            return False
        self._pending_aborts.add(request_id)
        self._wakeup.set()
        return True

    def stats(self) -> EngineStats:
        return EngineStats(scheduler=self._scheduler.stats(), executor_state=self.state, steps=self._steps,
                           active_requests=len(self._requests))

    @property
    def num_active(self) -> int:
        return len(self._requests)

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
            self._apply_aborts()
            if self._link.connected and self._link.generation != self._synced_generation:
                self._resync(self._link.info)  # replaced between steps: its KV (and prefix cache) is gone
            if not self._scheduler.has_unfinished():
                self._flush_deferred()
                self._wakeup.clear()
                if not self._pending_aborts and not self._stopping:
                    await self._wakeup.wait()
                continue
            plan = self._scheduler.schedule()
            if plan.is_empty:
                # Nothing can run right now (the scheduler waits on memory); don't spin.
                self._flush_deferred()
                self._wakeup.clear()
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
            self._deliver_or_defer(outputs)
            if self._metrics is not None:
                self._observe_step(plan, outputs, self._clock() - started)
        self._flush_deferred()
        self._fail_everything(FailureKind.UNAVAILABLE, "the server is shutting down")

    def _deliver_or_defer(self, outputs: list[SequenceOutput]) -> None:
        """Requests with stop strings are handled now: a completed stop string must finish its
        sequence before the next plan. Everything else waits until that plan is on its way."""
        urgent = []
        for output in outputs:
            active = self._requests.get(output.request_id)
            if active is not None and active.has_stop_strings:
                urgent.append(output)
            else:
                self._deferred.append(output)
        self._deliver(urgent)

    def _flush_deferred(self) -> None:
        if self._deferred:
            deferred, self._deferred = self._deferred, []
            self._deliver(deferred)

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
            if active is None or not 0 <= output.index < len(active.completions):
                continue
            completion = active.completions[output.index]
            if completion.finished:
                continue
            if not active.started:
                active.started = True
                self._queued_requests -= 1
                self._queued_prompt_tokens -= active.num_prompt_tokens
            self._deliver_one(active, completion, output)

    def _deliver_one(self, active: _ActiveRequest, completion: _Completion, output: SequenceOutput) -> None:
        token_ids = list(output.new_token_ids)
        finish = output.finish_reason
        # The token that finished a sequence (eos or a stop token id) is not part of the text.
        text_ids = token_ids[:-1] if finish in _TOKEN_FINISHES and token_ids else token_ids
        text = completion.text.push(text_ids)
        final_output = output
        if finish is None and completion.text.stopped:
            finish = FinishReason.STOP
            finished = self._scheduler.finish_sequence(active.request_id, output.index, FinishReason.STOP)
            if finished is not None:
                final_output = finished
                token_ids.extend(finished.new_token_ids)
        usage = None
        if finish is not None:
            text += completion.text.finish()
            completion.finished = True
            completion.finish_reason = finish
            usage = Usage(prompt_tokens=final_output.num_prompt_tokens,
                          completion_tokens=final_output.num_output_tokens,
                          cached_tokens=final_output.num_cached_tokens,
                          queue_time_s=final_output.queue_time_s or 0.0,
                          ttft_s=final_output.ttft_s or 0.0,
                          e2e_s=self._clock() - active.arrival)
            active.usage[output.index] = usage
        if self._metrics is not None and token_ids:
            now = self._clock()
            if completion.last_token_time is None:
                if output.ttft_s is not None:
                    self._metrics.observe_first_token(output.ttft_s)
            else:
                self._metrics.observe_token_gap(now - completion.last_token_time)
            completion.last_token_time = now
        active.stream.put(CompletionChunk(index=output.index, token_ids=token_ids, text=text,
                                          logprobs=list(output.logprobs or []), finish_reason=finish, usage=usage))
        if all(c.finished for c in active.completions):
            self._finish_request(active, finish)

    def _finish_request(self, active: _ActiveRequest, reason: FinishReason | None) -> None:
        """Close the stream, forget the request, and write its one canonical log line."""
        self._requests.pop(active.request_id, None)
        self._pending_aborts.discard(active.request_id)
        if not active.started:
            self._queued_requests -= 1
            self._queued_prompt_tokens -= active.num_prompt_tokens
        active.stream.close()
        usages = [u for u in active.usage if u is not None]
        first = usages[0] if usages else None
        duration_s = self._clock() - active.arrival
        if self._metrics is not None:
            for completion in active.completions:
                self._metrics.observe_finished(completion.finish_reason or reason or FinishReason.ABORT, duration_s,
                                               first.queue_time_s if first else None)
        active.log.info(
            "request_finished",
            prompt_tokens=active.num_prompt_tokens,
            completion_tokens=sum(u.completion_tokens for u in usages),
            cached_tokens=first.cached_tokens if first else 0,
            queue_time_s=round(first.queue_time_s, 6) if first else None,
            ttft_s=round(min(u.ttft_s for u in usages), 6) if usages else None,
            duration_s=round(duration_s, 6),
            finish_reason=",".join(sorted({(c.finish_reason or reason or FinishReason.ABORT).value
                                           for c in active.completions})),
            n=len(active.completions),
        )

    def _fail_everything(self, kind: FailureKind, message: str) -> None:
        """End every request with an error status and return all their blocks."""
        self._scheduler.fail_all(FinishReason.ERROR)
        self._pending_aborts.clear()
        for active in list(self._requests.values()):
            active.stream.fail(RequestFailed(kind, message))
            self._finish_request(active, FinishReason.ERROR)

    # --- executor failures -----------------------------------------------------------

    def _observe_step(self, plan: StepPlan, outputs: list[SequenceOutput], duration_s: float) -> None:
        """Prefill tokens: new sequences and multi-token chunks; generation tokens: what came back."""
        prompt_tokens = sum(s.num_scheduled_tokens for s in plan.new_seqs) + sum(
            s.num_scheduled_tokens for s in plan.known_seqs if s.num_scheduled_tokens > 1)
        generated = sum(len(o.new_token_ids) for o in outputs if o.finish_reason is not FinishReason.ABORT)
        self._metrics.observe_step(duration_s, self._scheduler.stats(), prompt_tokens, generated)

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
            self._apply_aborts()
            if self._unavailable_reason is None and self._clock() >= deadline:
                self._unavailable_reason = f"the executor was lost ({why}) and did not come back within {timeout:g} s"
                self._fail_everything(FailureKind.UNAVAILABLE, self._unavailable_reason)
            try:
                info = await self._link.wait_for_executor(timeout_s=_EXECUTOR_POLL_S)
                if self._link.connected:
                    break
            except (TimeoutError, asyncio.TimeoutError):
                continue
        if info is not None:
            self._resync(info)

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
            message = (f"the executor was lost {active.executor_losses} times while this request was in flight "
                       f"(last: {why}); not retrying it")
            active.log.warning("request_failed_after_executor_losses", losses=active.executor_losses)
            self._scheduler.abort(active.request_id, FinishReason.ERROR)
            active.stream.fail(RequestFailed(FailureKind.UNAVAILABLE, message))
            self._finish_request(active, FinishReason.ERROR)

    def _resync(self, info: ExecutorInfo) -> None:
        """A new executor holds nothing: recompute every sequence from the scheduler's state."""
        # Requests that no longer fit a smaller new pool come back as final ERROR outputs.
        self._deliver(self._scheduler.reset_executor(info.num_blocks))
        self._synced_generation = self._link.generation
        self._unavailable_reason = None
        if self._metrics is not None:
            self._metrics.inc_executor_restarts()
        log.info("executor_resynced", num_blocks=info.num_blocks, generation=self._link.generation,
                 active_requests=len(self._requests))
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
