"""The pure scheduling core: requests, KV blocks, the prefix tree and continuous batching.

No I/O, no asyncio, no grpc, no zmq, no torch: the service around it (`scheduler_svc.server`)
drives it one `schedule()`/`update()` pair per step, and imports it only from here (an
import-linter contract): everything below is the core's public API.
"""

from scheduler_svc.core.invariants import InvariantError
from scheduler_svc.core.kv_capacity import KvPlan, plan_kv
from scheduler_svc.core.outputs import BlockCounts, SampledLogprob, SchedulerStats, SequenceOutput
from scheduler_svc.core.request import RequestRejected
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import KV_RESERVATIONS, PREEMPTION_MODES, SchedulerConfig
from scheduler_svc.core.scheduler_view import SchedulerView
from scheduler_svc.core.token_matcher import MatcherFactory, TokenMatcher

__all__ = [
    "KV_RESERVATIONS",
    "PREEMPTION_MODES",
    "BlockCounts",
    "InvariantError",
    "KvPlan",
    "MatcherFactory",
    "RequestRejected",
    "SampledLogprob",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SchedulerView",
    "SequenceOutput",
    "TokenMatcher",
    "plan_kv",
]
