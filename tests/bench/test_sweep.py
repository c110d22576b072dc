"""`bench serve --sweep`: the spec, its points (waste at each run's own block size), table and plot."""

import math

import pytest

from kvserve.bench.load_driver import RequestRecord, RunResult
from kvserve.bench.plot import plot_sweep
from kvserve.bench.report import BenchReport, summarize_run
from kvserve.bench.sweep import SweepSpec, render_sweep_table, sweep_points


def test_parse_spec():
    spec = SweepSpec.parse("block-size=8,16, 32")
    assert spec == SweepSpec("block-size", ("8", "16", "32"))
    assert SweepSpec.parse("--max-num-batched-tokens=512").values == ("512",)
    assert spec.server_args("16") == ["--block-size", "16"]
    assert spec.variants()[0] == ("kvserve block-size=8", ["--block-size", "8"])
    for bad in ("block-size", "=8,16", "block-size=", "block-size=8,,16", "block-size=8,8", "port=1,2"):
        with pytest.raises(ValueError):
            SweepSpec.parse(bad)


def test_check_asks_kvserve_serve_before_any_server_starts():
    SweepSpec.parse("max-num-seqs=4,8").check()
    with pytest.raises(ValueError, match="unrecognized arguments"):
        SweepSpec.parse("no-such-flag=1").check()
    with pytest.raises(ValueError, match="invalid int value"):
        SweepSpec.parse("max-num-seqs=4,many").check()


def _run(configuration, block_size, lengths, peak=3):
    records = [
        RequestRecord(f"s{i}", 0, n - 4, 4, output_tokens=4, ttft_s=0.1 * (i + 1), e2e_s=1.0, itl_s=[0.05] * 3)
        for i, n in enumerate(lengths)
    ]
    return RunResult(configuration, "mixed", records, duration_s=2.0, peak_running=peak, block_size=block_size)


def test_points_count_waste_at_each_runs_block_size(tmp_path):
    spec = SweepSpec.parse("block-size=8,32")
    runs = [_run("kvserve block-size=8", 8, [20, 40]), _run("kvserve block-size=32", 32, [20, 40], peak=2)]
    report = BenchReport(meta={}, results=[summarize_run(r) for r in runs])
    sweep = sweep_points(spec, report, runs)
    assert sweep["flag"] == "block-size" and sweep["values"] == ["8", "32"]
    small, large = sweep["points"]
    assert (small["value"], small["block_size"], large["block_size"]) == ("8", 8, 32)
    assert small["kv_waste_pct"] == pytest.approx(100 * 4 / 64)  # 20 -> 24, 40 -> 40
    assert large["kv_waste_pct"] == pytest.approx(100 * 36 / 96)  # 20 -> 32, 40 -> 64
    assert large["peak_running"] == 2 and small["output_throughput"] == pytest.approx(4.0)
    assert small["ttft_p50"] == pytest.approx(0.15)
    table = render_sweep_table(sweep)
    assert table.splitlines()[1].startswith("--block-size") and "6.25" in table and "37.50" in table
    png = plot_sweep(sweep, tmp_path / "sweep.png")
    assert png.stat().st_size > 10_000


def test_point_without_a_block_size_has_no_waste_and_plots_categorical_values(tmp_path):
    spec = SweepSpec.parse("kv-reservation=paged,max-model-len")
    runs = [_run(spec.configuration(v), 0, [20]) for v in spec.values]
    report = BenchReport(meta={}, results=[summarize_run(r) for r in runs])
    sweep = sweep_points(spec, report, runs)
    assert [p["kv_waste_pct"] for p in sweep["points"]] == [None, None]
    assert "-" in render_sweep_table(sweep)
    assert plot_sweep(sweep, tmp_path / "s.png").exists()
    assert not any(math.isnan(p["output_throughput"]) for p in sweep["points"])
