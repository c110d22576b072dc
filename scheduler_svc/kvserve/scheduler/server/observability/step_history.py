"""What the last steps did and the last minutes' rates, kept by the engine for the engine view.

Recording is one tuple per step into a bounded deque and one per-second bucket update, so it
runs whether or not anyone watches: a viewer who opens the page sees the minutes before too.
The scheduler's prefix counters are cumulative, so each bucket keeps their values at its end
and a second's hit rate is the difference between two buckets.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.config import defaults
from kvserve.protos.step import StepPlan


@dataclass(frozen=True, slots=True)
class StepRecord:
    time: float
    """Wall-clock seconds (time.time) when the step's result was applied."""
    prefill_tokens: int
    """Prompt tokens computed: new sequences and multi-token chunks."""
    decode_rows: int
    """Rows of decoding sequences: one each, plus the drafts each verified (speculative decoding)."""


def step_composition(plan: StepPlan) -> tuple[int, int]:
    """(prefill tokens, decode rows) of a plan. A known sequence decodes when it schedules its
    next token and the drafts it verifies, nothing more; anything else it schedules is prompt (a
    chunk of a long prompt, or a recompute)."""
    prefill = sum(s.num_scheduled_tokens for s in plan.new_seqs)
    decode = 0
    for known in plan.known_seqs:
        if known.num_scheduled_tokens == 1 + len(known.draft_token_ids):
            decode += known.num_scheduled_tokens
        else:
            prefill += known.num_scheduled_tokens
    return prefill, decode


@dataclass(slots=True)
class _Second:
    second: int
    generated: int
    queried_total: int
    hit_total: int


class StepHistory:
    """The last `UI_STEP_HISTORY` steps and `UI_SERIES_SECONDS` one-second buckets of output and prefix hits."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.steps: deque[StepRecord] = deque(maxlen=defaults.UI_STEP_HISTORY)
        self._seconds: deque[_Second] = deque(maxlen=defaults.UI_SERIES_SECONDS + 1)

    def record(self, prefill_tokens: int, decode_rows: int, generated: int, queried_total: int, hit_total: int) -> None:
        """One step: its composition, the tokens it generated and the prefix counters after it."""
        now = self._clock()
        self.steps.append(StepRecord(now, prefill_tokens, decode_rows))
        second = int(now)
        last = self._seconds[-1] if self._seconds else None
        if last is not None and last.second == second:
            last.generated += generated
            last.queried_total, last.hit_total = queried_total, hit_total
        else:
            self._seconds.append(_Second(second, generated, queried_total, hit_total))

    def series(self) -> list[tuple[int, int, float | None]]:
        """(second, output tokens that second, prefix hit rate that second or None without lookups), oldest
        first, every second of the window up to now (idle seconds read 0 tokens and no hit rate)."""
        now = int(self._clock())
        start = now - defaults.UI_SERIES_SECONDS + 1
        by_second = {b.second: b for b in self._seconds}
        before: _Second | None = None
        points: list[tuple[int, int, float | None]] = []
        for earlier in self._seconds:  # the counters at the end of the last bucket before the window
            if earlier.second < start:
                before = earlier
        for second in range(start, now + 1):
            bucket = by_second.get(second)
            if bucket is None:
                points.append((second, 0, None))
                continue
            queried = bucket.queried_total - (before.queried_total if before else 0)
            hit = bucket.hit_total - (before.hit_total if before else 0)
            if queried < 0 or hit < 0:  # the counters restarted (a new scheduler after an executor restart)
                queried, hit = bucket.queried_total, bucket.hit_total
            points.append((second, bucket.generated, hit / queried if queried > 0 else None))
            before = bucket
        return points
