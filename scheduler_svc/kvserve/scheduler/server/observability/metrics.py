"""Prometheus metrics of one scheduler, named after vLLM's with a `kvserve:` prefix.

Each server gets its own `CollectorRegistry` (never the process-global one), so tests and
several servers in one process do not collide. The engine calls:

- `observe_step(duration_s, stats, prompt_tokens, generation_tokens)` after every step:
  gauges from the `SchedulerStats` snapshot, token counters, step-time histogram. The
  snapshot's prefix, preemption and speculative-decoding figures are cumulative; the counters advance by their
  growth (a reset after an executor re-sync counts from zero again). It also feeds the
  periodic stats log line (`kvserve.scheduler.server.observability.stats_logger`).
- `observe_first_token(ttft_s)`, `observe_token_gap(itl_s)` as tokens reach a request;
- `observe_finished(finish_reason, e2e_s, queue_time_s)` once per finished request;
- `inc_lora_requests(lora_name)` once per request submitted under a LoRA adapter (the base
  model's are not counted);
- `set_executor_up(up)`, `inc_executor_restarts()` on executor state changes;
- `start_http_server(host, port)` to serve `/metrics` (returns the bound port; 0 picks one).
"""

from __future__ import annotations

import enum
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import start_http_server as _prometheus_http_server

from kvserve.protos.kv_events import MEDIUM_CPU, MEDIUM_DISK
from kvserve.scheduler.core import SchedulerStats
from kvserve.scheduler.server.observability.stats_logger import STATS_LOG_INTERVAL_S, StatsLogger

PREFIX = "kvserve:"

TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
ITL_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    80.0,
)
REQUEST_BUCKETS_S = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)
ACCEPTED_LENGTH_BUCKETS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)
"""Accepted drafts per verifying sequence in a step: 0 up to --num-speculative-tokens (5 by default)."""
STEP_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def _reason_label(reason: Any) -> str:
    value = reason.value if isinstance(reason, enum.Enum) else reason
    return str(value).lower()


class ServerMetrics:
    """The metric set of one server, on its own registry; see the module docstring for the calls."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, log_interval_s: float = STATS_LOG_INTERVAL_S
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.stats_logger = StatsLogger(log_interval_s)
        r = self.registry
        self.num_requests_running = Gauge(
            PREFIX + "num_requests_running", "Requests running on the executor.", registry=r
        )
        self.num_requests_waiting = Gauge(
            PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.", registry=r
        )
        self.num_requests_swapped = Gauge(PREFIX + "num_requests_swapped", "Requests swapped out to CPU.", registry=r)
        self.kv_cache_usage_perc = Gauge(
            PREFIX + "kv_cache_usage_perc", "Fraction of KV blocks referenced by live sequences (1 = 100%).", registry=r
        )
        self.prefix_cache_queries = Counter(
            PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_cache_hits = Counter(
            PREFIX + "prefix_cache_hits", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.num_preemptions = Counter(PREFIX + "num_preemptions", "Sequences preempted.", registry=r)
        self.num_swap_outs = Counter(
            PREFIX + "num_swap_outs",
            "Preemptions that swapped a sequence's KV to CPU (the rest recompute).",
            registry=r,
        )
        self.prefix_cache_evictions = Counter(
            PREFIX + "prefix_cache_evictions", "Cached blocks taken back from the prefix tree.", registry=r
        )
        self.kv_disk_blocks = Gauge(
            PREFIX + "kv_disk_blocks",
            "KV blocks the tiers below the pool hold (--kv-host-gb, --kv-disk-dir).",
            registry=r,
        )
        self.kv_disk_loads = Counter(
            PREFIX + "kv_disk_loaded_blocks",
            "KV blocks read back from the disk tier instead of recomputed.",
            registry=r,
        )
        self.kv_disk_stores = Counter(
            PREFIX + "kv_disk_stored_blocks", "KV blocks written to the disk tier.", registry=r
        )
        self.kv_disk_failed_loads = Counter(
            PREFIX + "kv_disk_failed_loads",
            "Disk-tier loads whose file was missing or failed its checks (recomputed instead).",
            registry=r,
        )
        self.kv_host_loads = Counter(
            PREFIX + "kv_host_loaded_blocks",
            "KV blocks read back from the host-memory tier (--kv-host-gb) instead of recomputed.",
            registry=r,
        )
        self.kv_tier_loaded_bytes = Counter(
            PREFIX + "kv_tier_loaded_bytes",
            "Bytes of KV read back into the pool from a tier below it, by vLLM's medium name (CPU, DISK).",
            ["medium"],
            registry=r,
        )
        self.kv_tier_stored_bytes = Counter(
            PREFIX + "kv_tier_stored_bytes", "Bytes of KV written to the tiers below the pool.", registry=r
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens computed (prefill).", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.lora_requests = Counter(
            PREFIX + "lora_requests",
            "Requests submitted under each LoRA adapter (the base model's are not counted).",
            ["lora_name"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Arrival to first token.", buckets=TTFT_BUCKETS_S, registry=r
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Gap between consecutive tokens of a sequence.",
            buckets=ITL_BUCKETS_S,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to finish.", buckets=REQUEST_BUCKETS_S, registry=r
        )
        self.request_queue_time = Histogram(
            PREFIX + "request_queue_time_seconds", "Arrival to first scheduled.", buckets=REQUEST_BUCKETS_S, registry=r
        )
        self.step_duration = Histogram(
            PREFIX + "step_duration_seconds", "Wall time of one engine step.", buckets=STEP_BUCKETS_S, registry=r
        )
        self.executor_up = Gauge(PREFIX + "executor_up", "1 when an executor is connected and ready.", registry=r)
        self.executor_restarts = Counter(PREFIX + "executor_restarts", "Executors replaced after a loss.", registry=r)
        self.ui_view_build = Histogram(
            PREFIX + "ui_view_build_seconds",
            "Engine-loop time of one engine-view update, built for every viewer that shares it.",
            buckets=STEP_BUCKETS_S,
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            PREFIX + "spec_decode_num_draft_tokens", "Draft tokens sent for verification.", registry=r
        )
        self.spec_accepted_tokens = Counter(
            PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens the model's own draws confirmed.", registry=r
        )
        self.spec_bonus_tokens = Counter(
            PREFIX + "spec_decode_num_bonus_tokens",
            "Tokens a verification yields beyond its accepted drafts (one per sequence and step).",
            registry=r,
        )
        self.spec_mean_accepted_length = Histogram(
            PREFIX + "spec_decode_mean_accepted_length",
            "Per step that verified drafts: accepted drafts per verifying sequence.",
            buckets=ACCEPTED_LENGTH_BUCKETS,
            registry=r,
        )
        self._seen = {
            "queried": 0,
            "hits": 0,
            "preemptions": 0,
            "swap_outs": 0,
            "evictions": 0,
            "drafts": 0,
            "accepted": 0,
            "verify_steps": 0,
            "disk_loads": 0,
            "disk_stores": 0,
            "disk_failed": 0,
        }
        self._lock = threading.Lock()
        self._http_server: Any = None

    # --- engine calls ----------------------------------------------------------------

    def observe_step(
        self, duration_s: float, stats: SchedulerStats, prompt_tokens: int, generation_tokens: int
    ) -> None:
        """After every engine step: gauges, token counters, step time, and the periodic log line."""
        self.step_duration.observe(duration_s)
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_swapped.set(stats.num_swapped)
        self.kv_cache_usage_perc.set(stats.kv_usage)
        if prompt_tokens > 0:
            self.prompt_tokens.inc(prompt_tokens)
        if generation_tokens > 0:
            self.generation_tokens.inc(generation_tokens)
        with self._lock:
            self._advance(self.prefix_cache_queries, "queried", stats.prefix_queried_tokens)
            self._advance(self.prefix_cache_hits, "hits", stats.prefix_hit_tokens)
            self._advance(self.num_preemptions, "preemptions", stats.num_preemptions)
            self._advance(self.num_swap_outs, "swap_outs", stats.num_swap_outs)
            self._advance(self.prefix_cache_evictions, "evictions", stats.num_evicted_blocks)
            verified = self._advance(self.spec_bonus_tokens, "verify_steps", stats.draft_verify_steps)
            self._advance(self.spec_draft_tokens, "drafts", stats.draft_tokens_proposed)
            accepted = self._advance(self.spec_accepted_tokens, "accepted", stats.draft_tokens_accepted)
            if verified > 0:
                self.spec_mean_accepted_length.observe(accepted / verified)
            disk = stats.disk
            if disk is not None:
                self.kv_disk_blocks.set(disk.blocks_on_disk)
                size = disk.block_bytes
                disk_loads = self._advance(self.kv_disk_loads, "disk_loads", disk.loaded_blocks)
                stores = self._advance(self.kv_disk_stores, "disk_stores", disk.stored_blocks)
                self._advance(self.kv_disk_failed_loads, "disk_failed", disk.failed_loads)
                host_loads = self._advance(self.kv_host_loads, "host_loads", disk.host_loaded_blocks)
                self.kv_tier_loaded_bytes.labels(medium=MEDIUM_DISK).inc(disk_loads * size)
                self.kv_tier_loaded_bytes.labels(medium=MEDIUM_CPU).inc(host_loads * size)
                self.kv_tier_stored_bytes.inc(stores * size)
        self.stats_logger.observe_step(stats, prompt_tokens, generation_tokens)

    def observe_first_token(self, ttft_s: float) -> None:
        self.time_to_first_token.observe(ttft_s)

    def observe_token_gap(self, itl_s: float) -> None:
        self.inter_token_latency.observe(itl_s)

    def observe_finished(self, finish_reason: Any, e2e_s: float, queue_time_s: float | None) -> None:
        """Once per finished request; `finish_reason` is a FinishReason or its string ("stop", "length", ...)."""
        self.request_success.labels(finished_reason=_reason_label(finish_reason)).inc()
        self.e2e_request_latency.observe(e2e_s)
        if queue_time_s is not None:
            self.request_queue_time.observe(queue_time_s)

    def inc_lora_requests(self, lora_name: str) -> None:
        self.lora_requests.labels(lora_name=lora_name).inc()

    def set_executor_up(self, up: bool) -> None:
        self.executor_up.set(1 if up else 0)

    def inc_executor_restarts(self) -> None:
        self.executor_restarts.inc()

    # --- exposition ---------------------------------------------------------------------

    def scrape(self) -> str:
        """The text exposition format of this registry (what GET /metrics returns)."""
        return generate_latest(self.registry).decode()

    def start_http_server(self, host: str, port: int) -> int:
        """Serve /metrics on a daemon thread; returns the bound port (useful with port 0)."""
        server, _thread = _prometheus_http_server(port, addr=host, registry=self.registry)
        self._http_server = server
        return server.server_port

    def stop_http_server(self) -> None:
        server, self._http_server = self._http_server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def _advance(self, counter: Counter, key: str, total: int) -> int:
        """Move a counter by the growth of a cumulative total (returned); a total that went down restarted at 0."""
        last = self._seen.get(key, 0)
        delta = total - last if total >= last else total
        if delta > 0:
            counter.inc(delta)
        self._seen[key] = total
        return delta
