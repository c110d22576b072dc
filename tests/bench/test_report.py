import itertools
import json
import math

import pytest

from kvserve.bench.load_driver import RequestRecord, RunResult, arrival_offsets
from kvserve.bench.report import RATIO_KEYS, BenchReport, compute_ratios, render_table, summarize_run


def _run(configuration, workload, ttft, output_tokens=10, duration=2.0, prompt=100, cached=0, peak=0):
    records = [
        RequestRecord(
            f"s{i}",
            0,
            prompt,
            output_tokens,
            output_tokens=output_tokens,
            cached_tokens=cached,
            ttft_s=t,
            e2e_s=t + 0.9,
            itl_s=[0.1] * (output_tokens - 1),
        )
        for i, t in enumerate(ttft)
    ]
    return RunResult(configuration, workload, records, duration_s=duration, peak_running=peak)


def test_summary_figures():
    run = _run("kvserve", "mixed", [0.1, 0.2, 0.3, 0.4], output_tokens=10, duration=2.0, cached=25)
    run.records.append(RequestRecord("bad", 0, 100, 10, error="KVServeError: boom"))
    s = summarize_run(run)
    assert s["num_requests"] == 5 and s["num_failed"] == 1
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(20.0)
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert s["ttft"]["mean"] == pytest.approx(0.25)
    assert s["tpot"]["mean"] == pytest.approx(0.1)  # (e2e - ttft) / (10 - 1) = 0.9 / 9
    assert s["itl"]["count"] == 36


def test_ratios_from_runs():
    runs = [
        _run("kvserve", "mixed", [0.1], output_tokens=100, duration=1.0),  # 100 tok/s
        _run("hf-generate", "mixed", [math.nan], output_tokens=100, duration=10.0),  # 10 tok/s
        _run("kvserve", "cold-warm/cold", [1.0, 1.2], output_tokens=4),
        _run("kvserve", "cold-warm/warm", [0.1, 0.12], output_tokens=4),
        _run("kvserve", "shared-prefix", [0.2], output_tokens=4, prompt=1700, peak=30),
    ]
    report = BenchReport(meta={})
    report.results = [summarize_run(r) for r in runs]
    compute_ratios(
        report,
        runs,
        num_blocks=512,
        block_size=16,
        max_request_len_by_workload={"mixed": 600, "cold-warm": 1864, "shared-prefix": 1864},
    )
    assert report.ratios["vs_hf_throughput"] == pytest.approx(10.0)
    assert report.ratios["warm_vs_cold_ttft"] == pytest.approx(10.0)
    assert report.ratios["concurrency_vs_prealloc"] == pytest.approx(30 / 4)
    assert report.prealloc["by_workload"]["mixed"]["prealloc_concurrency"] == 8192 // 600
    # lengths: mixed 200 (13 blocks = 208, 8 waste); cold/warm 4 x 104 (7 blocks = 112, 8 waste each);
    # shared 1704 (107 blocks = 1712, 8 waste) -> 48 wasted of 2368 allocated; hf is not kvserve's trace
    assert report.ratios["kv_partial_block_waste_pct"] == pytest.approx(100 * 48 / (208 + 4 * 112 + 1712))
    assert report.kv_waste["by_workload"]["mixed"] == pytest.approx(100 * 8 / 208)
    assert "hf-generate" not in report.kv_waste["by_workload"]
    data = json.loads(report.to_json())
    assert set(data["ratios"]) == set(RATIO_KEYS)
    assert data["goals"]["vs_hf_throughput"]["met"] is True
    assert data["goals"]["warm_vs_cold_ttft"]["met"] is True
    assert data["goals"]["concurrency_vs_prealloc"]["met"] is True
    table = render_table(report)
    assert "vs_hf_throughput" in table and "10.00" in table


def test_missing_configurations_give_null_ratios_and_strict_json():
    runs = [_run("kvserve", "mixed", [0.1])]
    report = BenchReport(meta={})
    report.results = [summarize_run(r) for r in runs]
    compute_ratios(report, runs, num_blocks=512, block_size=16, max_request_len_by_workload={"mixed": 600})
    data = json.loads(report.to_json())  # allow_nan=False: NaN would raise
    assert data["ratios"]["vs_hf_throughput"] is None
    assert data["ratios"]["warm_vs_cold_ttft"] is None
    assert data["ratios"]["concurrency_vs_prealloc"] is None  # only shared-prefix gives it
    assert data["ratios"]["kv_partial_block_waste_pct"] is not None
    assert "not measured" in render_table(report)


def test_arrival_offsets():
    assert arrival_offsets(3, None, 0) == [0.0, 0.0, 0.0]
    a = arrival_offsets(2000, 10.0, seed=1)
    assert a == arrival_offsets(2000, 10.0, seed=1)
    assert a[0] == 0.0 and all(x < y for x, y in itertools.pairwise(a))
    assert a[-1] / 1999 == pytest.approx(0.1, rel=0.1)  # mean gap 1/rate


def test_target_ratios_compare_kvserve_with_each_target_per_workload():
    runs = [
        _run("kvserve", "mixed", [0.1, 0.3], output_tokens=100, duration=1.0),  # 200 tok/s, TTFT 0.2
        _run("llama-server", "mixed", [0.5, 0.7], output_tokens=100, duration=2.0),  # 100 tok/s, TTFT 0.6
        _run("kvserve", "shared-prefix", [1.0], output_tokens=10, duration=1.0),
        _run("slow", "mixed", [0.1], output_tokens=10, duration=1.0),  # 10 tok/s, TTFT 0.1
    ]
    report = BenchReport(meta={}, results=[summarize_run(r) for r in runs])
    lengths = {"mixed": 600, "shared-prefix": 1864}
    targets = ["llama-server", "slow", "absent"]
    compute_ratios(report, runs, num_blocks=0, block_size=16, max_request_len_by_workload=lengths, targets=targets)
    llama = report.target_ratios["llama-server"]
    assert set(llama) == {"mixed"}  # the target did not run shared-prefix
    assert llama["mixed"]["output_throughput_ratio"] == pytest.approx(2.0)
    assert llama["mixed"]["mean_ttft_ratio"] == pytest.approx(3.0)
    assert llama["mixed"]["met"] is True
    assert llama["mixed"]["num_requests"] == {"kvserve": 2, "llama-server": 2}
    slow = report.target_ratios["slow"]["mixed"]
    assert slow["output_throughput_ratio"] == pytest.approx(20.0)
    assert slow["mean_ttft_ratio"] == pytest.approx(0.5) and slow["met"] is False  # kvserve's TTFT is higher
    assert report.target_ratios["absent"] == {}
    data = json.loads(report.to_json())
    assert data["target_ratios"]["llama-server"]["mixed"]["met"] is True
    assert set(data["ratios"]) == set(RATIO_KEYS)  # the headline ratios are unchanged
    table = render_table(report)
    assert "vs llama-server (mixed)" in table and "2.00" in table and "3.00" in table
    assert "vs absent: not measured" in table


def test_three_tiers_put_the_prealloc_run_beside_its_estimate():
    runs = [
        _run("kvserve", "shared-prefix", [0.2, 0.3], output_tokens=4, prompt=1700, peak=30),
        _run("kvserve-no-cache", "shared-prefix", [1.0, 2.0], output_tokens=4, prompt=1700, peak=4),
        _run("kvserve-prealloc", "shared-prefix", [3.0, 4.0], output_tokens=4, prompt=1700, peak=3),
    ]
    runs[0].block_size = 32  # waste is counted at the run's own block size: 1704 -> 1728
    report = BenchReport(meta={}, results=[summarize_run(r) for r in runs])
    lengths = {"shared-prefix": 1864}
    compute_ratios(report, runs, num_blocks=512, block_size=16, max_request_len_by_workload=lengths)
    p = report.prealloc["by_workload"]["shared-prefix"]
    assert (p["prealloc_concurrency"], p["measured_prealloc_concurrency"]) == (4, 3)
    assert p["measured_ratio"] == pytest.approx(10.0)
    assert report.ratios["concurrency_vs_prealloc"] == pytest.approx(7.5)  # the headline stays the estimate
    tiers = report.tiers["shared-prefix"]
    assert tiers["prealloc_estimate"] == 4
    assert [t["configuration"] for t in tiers["tiers"]] == ["kvserve-prealloc", "kvserve-no-cache", "kvserve"]
    assert [t["peak_running"] for t in tiers["tiers"]] == [3, 4, 30]
    assert tiers["tiers"][0]["ttft_p99"] == pytest.approx(3.99)
    assert report.ratios["kv_partial_block_waste_pct"] == pytest.approx(100 * 2 * 24 / (2 * 1728))
    assert json.loads(report.to_json())["tiers"]["shared-prefix"]["tiers"][2]["tier"] == "paged + cache"
    table = render_table(report)
    assert "three tiers (shared-prefix)" in table and "3 (estimate 4)" in table
