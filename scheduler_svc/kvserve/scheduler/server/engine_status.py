"""The engine's status as the APIs report it: the executor's state and the engine's counters.

Health (`grpc.health.v1`, `/health`, `/ready`) and `ServerStats` read these; they are apart from
`engine.Engine`, which sets them, so an API can name a state without importing the loop that
drives the executor.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvserve.scheduler.core import SchedulerStats


class ExecutorState(str, enum.Enum):
    """Whether the engine has an executor to run plans on: READY, LOST (waiting for one to come
    back), or WAITING for the first."""

    WAITING = "waiting"
    READY = "ready"
    LOST = "lost"


@dataclass(slots=True)
class EngineStats:
    """One reading of the engine: the scheduler's counters, the executor's state, steps run and
    requests in flight."""

    scheduler: SchedulerStats
    executor_state: ExecutorState
    steps: int
    active_requests: int
