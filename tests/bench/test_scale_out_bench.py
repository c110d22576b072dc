"""`kvserve bench scale-out` end to end, on fake-executor servers and the real vllm-router.

The fake executor runs kvserve's real scheduler and prefix cache, so the hit rates are real
ones; only the model (and so TTFT and throughput) is not. The run must measure the single
replica and every policy asked for, with no failed request, and its report must show a
routed request's added latency next to the direct one.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from kvserve.bench.scale_out import SINGLE, ScaleOutBenchConfig, render, run_scale_out_bench

pytestmark = pytest.mark.timeout(600)


def test_one_replica_and_each_policy_on_the_same_requests() -> None:
    config = ScaleOutBenchConfig(
        executor="fake",
        policies=("cache_aware", "round_robin"),
        prefixes=4,
        num_requests=24,
        concurrency=4,
        replica_num_blocks=200,
        latency_requests=6,
        serve_args="--step-latency-ms 2",
        progress=False,
    )
    report = run_scale_out_bench(config, progress=lambda _line: None)
    by_name = {r["configuration"]: r for r in report["results"]}
    assert list(by_name) == [SINGLE, "2 replicas, cache_aware", "2 replicas, round_robin"]
    prompts = {r["total_prompt_tokens"] for r in by_name.values()}
    assert len(prompts) == 1, "every configuration got the same requests"
    for result in by_name.values():
        assert result["num_failed"] == 0, result["errors"]
        assert 0 < result["prefix_cache_hit_rate"] < 1
    # 24 requests over 4 prompts that all fit: 20 of them reuse ~1,000 of their ~1,125 tokens
    assert by_name[SINGLE]["prefix_cache_hit_rate"] > 0.5
    latency = report["router_latency"]
    assert latency["requests"] == 6 and all(math.isfinite(v) for v in latency.values())
    table = render(report)
    assert all(name in table for name in by_name) and "router added latency" in table
    assert report["meta"]["machine"]["cpu"], "the report says which CPU it ran on"


def test_help_names_the_workload_and_the_policies() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvserve", "bench", "scale-out", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "--policies" in out.stdout and "1,000-token" in out.stdout
