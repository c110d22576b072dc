"""Mean and percentiles of latency samples.

Percentiles use linear interpolation between closest ranks (the same rule as numpy's
default `method="linear"`): for q in [0, 100] over the sorted samples x[0..n-1], the
position is h = (n - 1) * q / 100 and the value is x[floor(h)] + (h - floor(h)) *
(x[floor(h) + 1] - x[floor(h)]). With few samples this reads smoother than nearest-rank
and never invents a value outside the observed range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no samples."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not samples:
        return math.nan
    ordered = sorted(samples)
    h = (len(ordered) - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (h - lo) * (ordered[hi] - ordered[lo])


@dataclass(slots=True)
class LatencySummary:
    """mean/p50/p90/p99 of one latency metric, in seconds (NaN when there were no samples)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def summarize(samples: Sequence[float]) -> LatencySummary:
    """Summary statistics of `samples`."""
    if not samples:
        return LatencySummary(count=0, mean=math.nan, p50=math.nan, p90=math.nan, p99=math.nan)
    return LatencySummary(
        count=len(samples),
        mean=math.fsum(samples) / len(samples),
        p50=percentile(samples, 50),
        p90=percentile(samples, 90),
        p99=percentile(samples, 99),
    )
