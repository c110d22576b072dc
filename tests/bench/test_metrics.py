import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.scheduler.core.outputs import SchedulerStats
from kvserve.scheduler.server.observability.metrics import ServerMetrics
from kvserve.scheduler.server.observability.stats_logger import StatsLogger


def _stats(**kw) -> SchedulerStats:
    base = dict(
        num_waiting=0,
        num_running=0,
        num_swapped=0,
        num_blocks=100,
        blocks_free=100,
        blocks_cached=0,
        blocks_referenced=0,
        kv_usage=0.0,
        prefix_queried_tokens=0,
        prefix_hit_tokens=0,
        num_preemptions=0,
    )
    base.update(kw)
    return SchedulerStats(**base)


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _value(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def test_counters_gauges_and_histograms_move():
    m = ServerMetrics(log_interval_s=0)
    m.observe_step(
        0.002,
        _stats(
            num_running=3,
            num_waiting=2,
            kv_usage=0.25,
            prefix_queried_tokens=100,
            prefix_hit_tokens=40,
            num_preemptions=1,
        ),
        prompt_tokens=60,
        generation_tokens=3,
    )
    m.observe_step(
        0.003,
        _stats(num_running=1, prefix_queried_tokens=150, prefix_hit_tokens=80, num_preemptions=1),
        prompt_tokens=10,
        generation_tokens=1,
    )
    m.observe_first_token(0.05)
    m.observe_token_gap(0.01)
    m.observe_token_gap(0.02)
    m.observe_finished("length", 1.5, 0.2)
    m.observe_finished("stop", 0.5, None)
    m.observe_finished("length", 2.0, 0.1)
    m.set_executor_up(True)
    m.inc_executor_restarts()
    s = _samples(m.scrape())
    assert _value(s, "kvserve:num_requests_running") == 1
    assert _value(s, "kvserve:num_requests_waiting") == 0
    assert _value(s, "kvserve:num_requests_swapped") == 0
    assert _value(s, "kvserve:kv_cache_usage_perc") == 0.0
    assert _value(s, "kvserve:prefix_cache_queries_total") == 150
    assert _value(s, "kvserve:prefix_cache_hits_total") == 80
    assert _value(s, "kvserve:num_preemptions_total") == 1
    assert _value(s, "kvserve:prompt_tokens_total") == 70
    assert _value(s, "kvserve:generation_tokens_total") == 4
    assert _value(s, "kvserve:request_success_total", finished_reason="length") == 2
    assert _value(s, "kvserve:request_success_total", finished_reason="stop") == 1
    assert _value(s, "kvserve:time_to_first_token_seconds_count") == 1
    assert _value(s, "kvserve:inter_token_latency_seconds_count") == 2
    assert _value(s, "kvserve:inter_token_latency_seconds_sum") == pytest.approx(0.03)
    assert _value(s, "kvserve:e2e_request_latency_seconds_count") == 3
    assert _value(s, "kvserve:request_queue_time_seconds_count") == 2
    assert _value(s, "kvserve:step_duration_seconds_count") == 2
    assert _value(s, "kvserve:step_duration_seconds_bucket", le="0.0025") == 1
    assert _value(s, "kvserve:executor_up") == 1
    assert _value(s, "kvserve:executor_restarts_total") == 1
    m.set_executor_up(False)
    assert _value(_samples(m.scrape()), "kvserve:executor_up") == 0


def test_cumulative_totals_that_reset_count_from_zero():
    m = ServerMetrics(log_interval_s=0)
    m.observe_step(0.001, _stats(prefix_queried_tokens=100, num_preemptions=5), 0, 0)
    m.observe_step(0.001, _stats(prefix_queried_tokens=30, num_preemptions=2), 0, 0)  # scheduler re-created
    s = _samples(m.scrape())
    assert _value(s, "kvserve:prefix_cache_queries_total") == 130
    assert _value(s, "kvserve:num_preemptions_total") == 7


def test_finish_reason_enum_label():
    import enum

    class Reason(enum.Enum):
        EOS = "eos"

    m = ServerMetrics(log_interval_s=0)
    m.observe_finished(Reason.EOS, 1.0, 0.0)
    assert _value(_samples(m.scrape()), "kvserve:request_success_total", finished_reason="eos") == 1


def test_registries_are_separate_and_http_endpoint_serves():
    a, b = ServerMetrics(log_interval_s=0), ServerMetrics(log_interval_s=0)
    a.observe_step(0.001, _stats(), 5, 0)
    assert _value(_samples(b.scrape()), "kvserve:prompt_tokens_total") == 0
    port = a.start_http_server("127.0.0.1", 0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        a.stop_http_server()
    assert _value(_samples(body), "kvserve:prompt_tokens_total") == 5


class _Recorder:
    def __init__(self):
        self.lines = []

    def info(self, event, **fields):
        self.lines.append((event, fields))


def test_stats_logger_logs_interval_figures_only_when_busy():
    now = [0.0]
    rec = _Recorder()
    logger = StatsLogger(5.0, clock=lambda: now[0], logger=rec)
    now[0] = 1.0
    assert logger.observe_step(_stats(num_running=2, prefix_queried_tokens=100, prefix_hit_tokens=25), 400, 2) is None
    now[0] = 5.0
    fields = logger.observe_step(
        _stats(
            num_running=2,
            num_waiting=1,
            kv_usage=0.5,
            prefix_queried_tokens=200,
            prefix_hit_tokens=75,
            num_preemptions=3,
        ),
        100,
        8,
    )
    assert fields == {
        "prompt_throughput_tps": 100.0,
        "generation_throughput_tps": 2.0,
        "running": 2,
        "waiting": 1,
        "swapped": 0,
        "kv_usage_pct": 50.0,
        "prefix_hit_rate_pct": 37.5,
        "preemptions": 3,
        "blocks_free": 100,
        "blocks_cached": 0,
        "blocks_referenced": 0,
        "blocks_reserved": 0,
    }
    assert rec.lines == [("engine stats", fields)]
    now[0] = 12.0  # next window: hit rate only over its own queries
    fields = logger.observe_step(
        _stats(num_running=1, prefix_queried_tokens=300, prefix_hit_tokens=175, num_preemptions=3), 70, 7
    )
    assert fields["prefix_hit_rate_pct"] == 100.0 and fields["preemptions"] == 0
    assert fields["prompt_throughput_tps"] == 10.0
    now[0] = 20.0  # idle: no tokens, nothing running
    assert (
        logger.observe_step(_stats(prefix_queried_tokens=300, prefix_hit_tokens=175, num_preemptions=3), 0, 0) is None
    )
    assert len(rec.lines) == 2
