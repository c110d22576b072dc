"""The pure scheduling core: requests, KV blocks, the prefix tree and continuous batching.

No I/O, no asyncio, no grpc, no zmq, no torch: the service around it (`kvserve.scheduler.server`)
drives it one `schedule()`/`update()` pair per step, and imports it only from here (an
import-linter contract): everything below is the core's public API.
"""

from kvserve.scheduler.core.invariants import InvariantError
from kvserve.scheduler.core.kv_capacity import KvPlan, plan_kv
from kvserve.scheduler.core.outputs import (
    BlockCounts,
    DiskTierStats,
    DraftCounts,
    SampledLogprob,
    SchedulerStats,
    SequenceOutput,
)
from kvserve.scheduler.core.prefix_tree import PrefixNode, PrefixTreeListener
from kvserve.scheduler.core.request import RequestRejected, Sequence
from kvserve.scheduler.core.scheduler import Scheduler
from kvserve.scheduler.core.scheduler_config import KV_RESERVATIONS, PREEMPTION_MODES, SchedulerConfig
from kvserve.scheduler.core.scheduler_view import SchedulerView
from kvserve.scheduler.core.token_matcher import MatcherFactory, TokenMatcher

__all__ = [
    "KV_RESERVATIONS",
    "PREEMPTION_MODES",
    "BlockCounts",
    "DiskTierStats",
    "DraftCounts",
    "InvariantError",
    "KvPlan",
    "MatcherFactory",
    "PrefixNode",
    "PrefixTreeListener",
    "RequestRejected",
    "SampledLogprob",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SchedulerView",
    "Sequence",
    "SequenceOutput",
    "TokenMatcher",
    "plan_kv",
]
