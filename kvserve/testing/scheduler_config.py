"""SchedulerConfig for scheduling-core tests: invariants checked after every step, each module's own defaults.

Each test module of `tests/scheduler` sizes a small pool for its cases (`checked_configs(num_blocks=6, …)`)
and each test overrides what it is about (`config(max_num_seqs=1)`); one place turns the invariant checks
on, so no module can forget them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve.scheduler.core.scheduler_config import SchedulerConfig


def checked_config(**fields: Any) -> SchedulerConfig:
    """A SchedulerConfig of `fields` with `debug_invariants` on (a test may still turn it off)."""
    return SchedulerConfig(**{"debug_invariants": True, **fields})


def checked_configs(**defaults: Any) -> Callable[..., SchedulerConfig]:
    """`config(**overrides)` for one test module: `checked_config` of its `defaults`, then the overrides."""

    def config(**overrides: Any) -> SchedulerConfig:
        return checked_config(**{**defaults, **overrides})

    return config
