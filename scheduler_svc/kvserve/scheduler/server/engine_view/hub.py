"""Engine-view streams: one ticker builds each update once per kind of viewer and hands it to every subscriber.

Viewers never touch the scheduler themselves. While anyone watches, a task on the engine's
loop wakes every `interval_s`, builds one snapshot per distinct `Viewer` (a tenant sees its
own, so five viewers of one tenant cost one build) between two engine steps, and leaves it
in each subscriber's one-slot mailbox (a newcomer gets the next one, so connecting again and
again cannot make more builds). An update that took long to build pushes the next one back,
so the views never take more than `UI_MAX_LOOP_SHARE` of the loop. A slow reader misses
updates rather than queueing them, so memory stays bounded by the number of viewers. With no
viewers the task ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

import structlog

from kvserve.config import defaults
from kvserve.scheduler.server.engine_view.snapshot import EngineSources, Viewer, build_view, fit_event
from kvserve.scheduler.server.observability.metrics import ServerMetrics
from kvserve.scheduler.server.serving_model import ServingModel

log = structlog.get_logger(__name__)


class TooManyViewers(RuntimeError):
    """`UI_MAX_VIEWERS` streams are open already."""


@dataclass(eq=False, slots=True)
class _Subscriber:
    viewer: Viewer
    latest: bytes | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class ViewHub:
    def __init__(
        self, model_source: Callable[[], ServingModel | None], interval_s: float, metrics: ServerMetrics | None = None
    ) -> None:
        self._model_source = model_source
        self._interval_s = interval_s
        self._metrics = metrics
        self._subscribers: set[_Subscriber] = set()
        self._task: asyncio.Task[None] | None = None

    async def stream(self, viewer: Viewer) -> AsyncGenerator[bytes, None]:
        """Each update `viewer` may see, as encoded JSON, until the caller stops iterating.

        Raises TooManyViewers before the first update when the hub is full."""
        subscriber = self._subscribe(viewer)
        try:
            while True:
                await subscriber.ready.wait()
                subscriber.ready.clear()
                if subscriber.latest is not None:
                    yield subscriber.latest
        finally:
            self._subscribers.discard(subscriber)

    def _subscribe(self, viewer: Viewer) -> _Subscriber:
        if len(self._subscribers) >= defaults.UI_MAX_VIEWERS:
            raise TooManyViewers(f"{defaults.UI_MAX_VIEWERS} engine-view streams are open; close one or retry later")
        subscriber = _Subscriber(viewer)
        self._subscribers.add(subscriber)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._tick())
        return subscriber

    async def _tick(self) -> None:
        try:
            while self._subscribers:
                took = self._publish(list(self._subscribers))
                await asyncio.sleep(max(self._interval_s, took / defaults.UI_MAX_LOOP_SHARE - took))
        except Exception:  # a bug here must not take the server down with it; the viewers just stop
            log.exception("engine_view_failed")
            raise

    def _publish(self, subscribers: list[_Subscriber]) -> float:
        """Build and hand out one update per kind of viewer; returns the seconds it took."""
        model = self._model_source()
        if model is None:
            return 0.0  # no executor has registered yet: nothing to show
        started = time.perf_counter()
        engine = model.engine
        sources = EngineSources(
            view=engine.view(),
            history=engine.history,
            owners=engine.namespace_owners,
            decode=lambda ids: model.tokenizer.decode(ids, skip_special_tokens=False),
            executor_state=engine.state.value,
            now_wall=time.time(),
            now_monotonic=time.monotonic(),
        )
        built: dict[Viewer, bytes] = {}
        for subscriber in subscribers:
            data = built.get(subscriber.viewer)
            if data is None:
                data = built[subscriber.viewer] = fit_event(build_view(sources, subscriber.viewer))
            subscriber.latest = data
            subscriber.ready.set()
        took = time.perf_counter() - started
        if self._metrics is not None:
            self._metrics.ui_view_build.observe(took)
        return took
