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
    single = ("mixed", "shared-prefix", "multi-turn", "multi-prefix", "copy")
    kv = [("kvserve", w) for w in (*single, "cold-warm/cold", "cold-warm/warm")]
    nc = [("kvserve-no-cache", w) for w in single]
    pa = [("kvserve-prealloc", w) for w in single]  # one server per workload
    _check_common(data, set(kv + nc + pa))
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


def _fake_bench(kvserve_cli, tmp_path, *args, timeout_s=240):
    """`bench serve` on fake-executor servers it starts; the JSON report and the PNG's path."""
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = kvserve_cli(
        [
            *("bench", "serve", "--start-server", "--executor", "fake", "--no-progress"),
            *args,
            *("--json", str(out), "--plot", str(plot)),
        ],
        timeout_s=timeout_s,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), plot, proc.stdout


def test_bench_serve_sweep_block_size(tmp_path, kvserve_cli):
    data, plot, stdout = _fake_bench(
        kvserve_cli,
        tmp_path,
        *("--workload", "mixed", "--num-requests", "4", "--concurrency", "4", "--max-tokens-cap", "6"),
        *("--server-arg=--step-latency-ms=5", "--sweep", "block-size=8,16"),
    )
    names = ["kvserve block-size=8", "kvserve block-size=16"]
    _check_common(data, {(name, "mixed") for name in names})
    sweep = data["sweep"]
    assert sweep["flag"] == "block-size" and sweep["values"] == ["8", "16"]
    assert [(p["value"], p["block_size"]) for p in sweep["points"]] == [("8", 8), ("16", 16)]  # one per value
    small, large = sweep["points"]
    for p in sweep["points"]:
        assert p["output_throughput"] > 0 and p["ttft_p99"] >= p["ttft_p50"] > 0 and p["itl_p99"] > 0
        assert 1 <= p["peak_running"] <= 4
    # The same requests, so the same lengths: smaller blocks can only waste less of their last block.
    assert 0 < small["kv_waste_pct"] <= large["kv_waste_pct"] < 50
    assert [r["block_size"] for r in data["results"]] == [8, 16]
    assert plot.stat().st_size > 10_000
    assert "sweep over --block-size" in stdout and "KV waste %" in stdout


def test_bench_serve_prealloc_tier_runs_beside_the_paged_tiers(tmp_path, kvserve_cli):
    # shared-prefix's longest request here is 1,802 tokens = 113 blocks: 240 blocks (3,840 tokens) fit two
    # whole-length reservations, while the paged cache shares the 1,500-token prefix among all six.
    data, plot, stdout = _fake_bench(
        kvserve_cli,
        tmp_path,
        *("--workload", "shared-prefix", "--num-requests", "6", "--concurrency", "6", "--max-tokens-cap", "16"),
        *("--server-arg=--step-latency-ms=20", "--server-arg=--num-blocks=240"),
        *("--baselines", "no-cache", "prealloc"),
    )
    configurations = ("kvserve", "kvserve-no-cache", "kvserve-prealloc")
    _check_common(data, {(c, "shared-prefix") for c in configurations})
    tiers = data["tiers"]["shared-prefix"]
    assert [t["configuration"] for t in tiers["tiers"]] == ["kvserve-prealloc", "kvserve-no-cache", "kvserve"]
    prealloc, no_cache, paged = (t["peak_running"] for t in tiers["tiers"])
    assert tiers["prealloc_estimate"] == 3840 // 1802 == 2
    assert 1 <= prealloc <= tiers["prealloc_estimate"]  # whole-length reservations: at most two at once
    assert prealloc <= no_cache and prealloc <= paged
    estimate = data["prealloc"]["by_workload"]["shared-prefix"]
    assert estimate["measured_prealloc_concurrency"] == prealloc
    assert data["ratios"]["concurrency_vs_prealloc"] == estimate["ratio"]
    by = {r["configuration"]: r for r in data["results"]}
    assert by["kvserve-prealloc"]["prefix_cache_hit_rate"] == 0.0  # the tier runs without the prefix cache
    assert by["kvserve"]["prefix_cache_hit_rate"] > 0.5
    assert plot.stat().st_size > 10_000
    assert "three tiers (shared-prefix)" in stdout and "(estimate 2)" in stdout


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
    # no-cache: see the fake-executor test; prealloc runs its tier for real beside the estimate
    _check_common(data, {("kvserve", "mixed"), ("hf-generate", "mixed"), ("kvserve-prealloc", "mixed")})
    for key in ("vs_hf_throughput", "kv_partial_block_waste_pct"):
        assert data["ratios"][key] is not None and data["ratios"][key] > 0, key
    assert data["ratios"]["concurrency_vs_prealloc"] is None  # needs shared-prefix
    assert data["prealloc"]["by_workload"]["mixed"]["prealloc_concurrency"] > 0
    assert data["meta"]["model"]["executor_kind"] == "torch"
    assert data["meta"]["hf_generated_tokens"] >= 4 * 8
