"""`GET /ready`: ready only when an executor is registered and the engine is demonstrably stepping.

An executor can be registered and still unable to step (hung, or lost a moment ago and
not yet declared so), so readiness asks for evidence: a step completed within
`READY_RECENT_STEP_S`, else a one-token request of our own that completes within
`READY_PROBE_TIMEOUT_S`. Under load the steps are the evidence; an idle server pays one
tiny step per probe, and concurrent checks share one probe. A probe is not a client's request, so
it stays out of the request metrics (a router checking every second would otherwise add a served
request to `/metrics` each second the replica idles).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable

import structlog

from kvserve.config import defaults
from kvserve.protos.kvserve.v1 import api_pb2
from kvserve.protos.sampling import InvalidFieldError
from kvserve.scheduler.core import RequestRejected
from kvserve.scheduler.server.delivery.request_stream import RequestFailed
from kvserve.scheduler.server.engine_status import ExecutorState
from kvserve.scheduler.server.intake.request_parsing import parse_generate
from kvserve.scheduler.server.security.namespaces import prefix_namespace, scoped_request_id
from kvserve.scheduler.server.serving_model import ServingModel

log = structlog.get_logger(__name__)

PROBE_TENANT = "<ready-probe>"
"""Not a valid tenant name (auth.TENANT_NAME), so no caller's id or prefix namespace can collide with a probe's."""


class ReadinessCheck:
    """`check()` returns None when ready, else why not."""

    def __init__(
        self,
        model_source: Callable[[], ServingModel | None],
        *,
        recent_s: float = defaults.READY_RECENT_STEP_S,
        probe_timeout_s: float = defaults.READY_PROBE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._model_source = model_source
        self._recent_s = recent_s
        self._probe_timeout_s = probe_timeout_s
        self._clock = clock
        self._steps_seen = -1
        self._seen_at = float("-inf")
        self._probe_ok_at = float("-inf")
        self._probe: asyncio.Task[str | None] | None = None

    async def check(self, draining: bool = False) -> str | None:
        model = self._model_source()
        if model is None:
            return "no executor has registered yet"
        if draining:
            return "the server is draining"
        stats = model.engine.stats()
        if stats.executor_state is not ExecutorState.READY:
            return f"the executor is {stats.executor_state.value}"
        now = self._clock()
        stepped = stats.steps != self._steps_seen and now - self._seen_at <= self._recent_s
        self._steps_seen, self._seen_at = stats.steps, now
        if stepped or now - self._probe_ok_at <= self._recent_s:
            return None
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._run_probe(model))
        return await asyncio.shield(self._probe)

    async def _run_probe(self, model: ServingModel) -> str | None:
        request = api_pb2.GenerateRequest(
            token_ids=api_pb2.TokenIds(ids=[_probe_token(model)]),
            sampling=api_pb2.SamplingParams(max_tokens=1, temperature=0.0),
            request_id=f"probe-{uuid.uuid4().hex}",
        )
        try:
            validated = parse_generate(request, model.tokenizer, model.limits)
        except InvalidFieldError as exc:  # pragma: no cover - a one-token prompt always fits
            return f"probe refused: {exc}"
        scoped_id = scoped_request_id(PROBE_TENANT, validated.request_id)
        try:
            stream = model.engine.submit(
                dataclasses.replace(validated, request_id=scoped_id),
                prefix_namespace(model.info.model_id, PROBE_TENANT),
                internal=True,
            )
        except RequestFailed as exc:
            return f"probe refused: {exc.message}"
        except RequestRejected as exc:  # pragma: no cover - a one-token request fits any pool
            return f"probe refused: {exc}"
        try:
            async with asyncio.timeout(self._probe_timeout_s):
                async for _ in stream:
                    pass
        except TimeoutError:
            log.warning("ready_probe_timed_out", timeout_s=self._probe_timeout_s)
            return f"a one-token probe did not complete within {self._probe_timeout_s:g} s"
        except RequestFailed as exc:
            return f"probe failed: {exc.message}"
        finally:
            if not stream.closed:
                model.engine.abort(scoped_id)
        self._probe_ok_at = self._clock()
        return None


def _probe_token(model: ServingModel) -> int:
    ids = model.tokenizer.encode("ready")
    return ids[-1] if ids else 0
