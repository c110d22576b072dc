"""Compile structured-output specs off the event loop, once per spec, and cache them.

A request waits here, before it is queued, until its grammar is ready: compiling never
stalls the engine loop or the running batch (vLLM holds such a request in a waiting
state for the same reason). A spec that fails to compile fails the request with
INVALID_ARGUMENT before any token exists. Concurrent requests with the same spec share
one compilation; compiled grammars are kept in an LRU keyed by the spec, and the
compiler belongs to one served tokenizer, so the key is (spec, tokenizer).
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable

import structlog

from kvserve.scheduler.core import MatcherFactory
from kvserve.scheduler.server.structured.backend import GrammarBackend
from kvserve.scheduler.server.structured.spec import StructuredSpec

log = structlog.get_logger(__name__)

CacheKey = tuple[str, str, tuple[str, ...]]


class GrammarCompiler:
    """`await compile(spec)` → a `MatcherFactory`, or InvalidFieldError naming the spec's field."""

    def __init__(self, make_backend: Callable[[], GrammarBackend], max_cached: int) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._max_cached = max_cached
        self._cache: OrderedDict[CacheKey, MatcherFactory] = OrderedDict()
        self._pending: dict[CacheKey, asyncio.Future[MatcherFactory]] = {}
        self.compiled = 0
        """Compilations run (the cache's misses), for tests and logs."""

    async def constraint(self, spec: StructuredSpec | None) -> MatcherFactory | None:
        """The request's compiled constraint; None for a request without one."""
        return None if spec is None else await self.compile(spec)

    async def compile(self, spec: StructuredSpec) -> MatcherFactory:
        key = spec.cache_key
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        pending = self._pending.get(key)
        if pending is None:
            pending = asyncio.ensure_future(asyncio.to_thread(self._compile, spec))
            self._pending[key] = pending
            pending.add_done_callback(lambda done: self._settle(key, done))
        # shield: a client that goes away does not cancel a compilation others may share.
        return await asyncio.shield(pending)

    def _settle(self, key: CacheKey, done: asyncio.Future[MatcherFactory]) -> None:
        del self._pending[key]
        if done.cancelled() or done.exception() is not None:
            return  # a refused spec is not cached: its error names the field of each request
        self._cache[key] = done.result()
        while len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)

    def _compile(self, spec: StructuredSpec) -> MatcherFactory:
        backend = self._ensure_backend()
        factory = backend.compile(spec)
        self.compiled += 1
        log.debug("grammar compiled", kind=spec.kind, backend=backend.name)
        return factory

    def _ensure_backend(self) -> GrammarBackend:
        with self._backend_lock:  # the first requests race to build it; it is built once
            if self._backend is None:
                self._backend = self._make_backend()
                log.info("grammar engine ready", backend=self._backend.name)
            return self._backend
