"""`kvserve bench serve` end to end: it starts its servers, drives them, and writes every field."""

import json

import pytest

from kvserve.bench.report import LATENCY_KEYS, RATIO_KEYS

SUMMARY_KEYS = {
    "configuration",
    "workload",
    "num_requests",
    "num_failed",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "total_prompt_tokens",
    "total_output_tokens",
    "cached_tokens",
    "prefix_cache_hit_rate",
    "server_prefix_hit_rate",
    "preemptions",
    "peak_running",
    *LATENCY_KEYS,
}


def _check_common(data, expected_pairs):
    assert set(data) >= {"ratios", "goals", "meta", "results", "prealloc", "kv_waste"}
    assert set(data["ratios"]) == set(RATIO_KEYS)
    pairs = {(r["configuration"], r["workload"]) for r in data["results"]}
    assert pairs == expected_pairs
    for r in data["results"]:
        assert set(r) >= SUMMARY_KEYS
        assert r["num_failed"] == 0, r["errors"]
        assert r["total_output_tokens"] > 0
        assert r["output_throughput"] > 0
        for key in LATENCY_KEYS:
            assert set(r[key]) == {"count", "mean", "p50", "p90", "p99"}
    assert data["meta"]["command"].startswith("kvserve bench serve")
    for key in ("date", "machine", "versions", "model", "config"):
        assert key in data["meta"]


def test_bench_serve_fake_executor_all_workloads(tmp_path, kvserve_cli):
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = kvserve_cli(
        [
            "bench",
            "serve",
            "--workload",
            "all",
            "--num-requests",
            "6",
            "--concurrency",
            "3",
            "--max-tokens-cap",
            "6",
            "--start-server",
            "--executor",
            "fake",
            "--server-arg=--step-latency-ms=5",
            "--baselines",
            "no-cache",
            "prealloc",
            "--json",
            str(out),
            "--plot",
            str(plot),
            "--no-progress",
        ],
        timeout_s=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    kv = [("kvserve", w) for w in ("mixed", "shared-prefix", "multi-turn", "cold-warm/cold", "cold-warm/warm")]
    nc = [("kvserve-no-cache", w) for w in ("mixed", "shared-prefix", "multi-turn")]
    _check_common(data, set(kv + nc))
    by = {(r["configuration"], r["workload"]): r for r in data["results"]}
    # Every request carries ignore_eos, so outputs have exactly their (capped) lengths.
    assert by[("kvserve", "mixed")]["total_output_tokens"] == 6 * 6
    # The shared 1,500-token prefix is reused with caching on, never with it off.
    assert by[("kvserve", "shared-prefix")]["prefix_cache_hit_rate"] > 0.6
    assert by[("kvserve-no-cache", "shared-prefix")]["prefix_cache_hit_rate"] == 0.0
    assert by[("kvserve", "cold-warm/cold")]["cached_tokens"] == 0
    assert by[("kvserve", "cold-warm/warm")]["prefix_cache_hit_rate"] > 0.8
    # The multi-turn chats resend their history, which the cache serves.
    assert by[("kvserve", "multi-turn")]["cached_tokens"] > 0
    assert data["ratios"]["vs_hf_throughput"] is None  # hf not requested
    assert data["ratios"]["warm_vs_cold_ttft"] > 0
    assert data["ratios"]["concurrency_vs_prealloc"] > 0
    assert 1 <= by[("kvserve", "shared-prefix")]["peak_running"] <= 3  # --concurrency 3
    assert 0 < data["ratios"]["kv_partial_block_waste_pct"] < 50
    assert data["prealloc"]["by_workload"]["shared-prefix"]["ratio"] == data["ratios"]["concurrency_vs_prealloc"]
    assert plot.stat().st_size > 10_000
    assert "warm_vs_cold_ttft" in proc.stdout


@pytest.mark.slow
def test_bench_serve_real_model_with_hf_baseline(tmp_path, kvserve_cli, default_model_dir):
    out = tmp_path / "bench.json"
    proc = kvserve_cli(
        [
            "bench",
            "serve",
            "--workload",
            "mixed",
            "--num-requests",
            "4",
            "--concurrency",
            "4",
            "--max-tokens-cap",
            "8",
            "--start-server",
            "--executor",
            "torch",
            "--hf-batch-size",
            "4",
            "--server-arg=--kv-cache-gb=0.25",
            "--baselines",
            "hf",
            "prealloc",
            "--json",
            str(out),
            "--no-progress",
        ],
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    _check_common(data, {("kvserve", "mixed"), ("hf-generate", "mixed")})  # no-cache: see the fake-executor test
    for key in ("vs_hf_throughput", "kv_partial_block_waste_pct"):
        assert data["ratios"][key] is not None and data["ratios"][key] > 0, key
    assert data["ratios"]["concurrency_vs_prealloc"] is None  # needs shared-prefix
    assert data["prealloc"]["by_workload"]["mixed"]["prealloc_concurrency"] > 0
    assert data["meta"]["model"]["executor_kind"] == "torch"
    assert data["meta"]["hf_generated_tokens"] >= 4 * 8
