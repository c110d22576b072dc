"""A periodic engine-stats log line, like vLLM's, every few seconds while the engine is busy.

The engine feeds every step to `observe_step`; once `interval_s` has passed since the last
line, and the interval saw tokens or there are requests in flight, one structlog line goes
out with prompt and generation throughput over the interval, running/waiting/swapped counts,
KV usage, the pool's free, cached (evictable), referenced and reserved blocks at the end of the
interval, preemptions in the interval and the prefix-cache hit rate over the interval's queries.
An idle engine takes no steps, so it logs nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

from kvserve.scheduler.core import SchedulerStats

log = structlog.get_logger(__name__)

STATS_LOG_INTERVAL_S = 5.0
"""Seconds between two stats lines (0 turns the line off)."""


class StatsLogger:
    """Accumulates per-step token counts and logs one summary line per interval."""

    def __init__(
        self,
        interval_s: float = STATS_LOG_INTERVAL_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        logger: Any = None,
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._log = logger if logger is not None else log
        self._window_start = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last: SchedulerStats | None = None
        self._base_queried = self._base_hits = self._base_preemptions = 0

    def observe_step(self, stats: SchedulerStats, prompt_tokens: int, generation_tokens: int) -> dict[str, Any] | None:
        """Count one step; returns the fields of the line when one was logged."""
        self._prompt_tokens += prompt_tokens
        self._generation_tokens += generation_tokens
        self._last = stats
        return self.maybe_log()

    def maybe_log(self, now: float | None = None) -> dict[str, Any] | None:
        """Log the line if the interval has passed and there was work; also callable from a timer."""
        if self.interval_s <= 0 or self._last is None:
            return None
        now = self._clock() if now is None else now
        elapsed = now - self._window_start
        if elapsed < self.interval_s:
            return None
        stats = self._last
        busy = self._prompt_tokens or self._generation_tokens or stats.num_running or stats.num_waiting
        fields = None
        if busy:
            queried = stats.prefix_queried_tokens - self._base_queried
            hits = stats.prefix_hit_tokens - self._base_hits
            fields = {
                "prompt_throughput_tps": round(self._prompt_tokens / elapsed, 1),
                "generation_throughput_tps": round(self._generation_tokens / elapsed, 1),
                "running": stats.num_running,
                "waiting": stats.num_waiting,
                "swapped": stats.num_swapped,
                "kv_usage_pct": round(100.0 * stats.kv_usage, 1),
                "blocks_free": stats.blocks_free,
                "blocks_cached": stats.blocks_cached,
                "blocks_referenced": stats.blocks_referenced,
                "blocks_reserved": stats.blocks_reserved,
                "prefix_hit_rate_pct": round(100.0 * hits / queried, 1) if queried > 0 else 0.0,
                "preemptions": max(0, stats.num_preemptions - self._base_preemptions),
            }
            self._log.info("engine stats", **fields)
        self._window_start = now
        self._prompt_tokens = self._generation_tokens = 0
        self._base_queried, self._base_hits = stats.prefix_queried_tokens, stats.prefix_hit_tokens
        self._base_preemptions = stats.num_preemptions
        return fields
