"""`python -m kvserve.bench.cpu_table`: the one-run CPU table and its goal verdicts, from fixture files."""

from __future__ import annotations

import json
from pathlib import Path

from kvserve.bench.cpu_table import build_rows, main, ratio_lines


def _llama(out: Path, tg: dict[int, float], pp: float) -> None:
    lines = [json.dumps({"pl": b, "speed_tg": v, "speed_pp": pp}) for b, v in tg.items()]
    (out / "llama-batched.jsonl").write_text("\n".join(lines) + "\n")


def _executor(out: Path, config: str, decode: dict[int, float], prefill: float, rss: float, **chose: str) -> None:
    """`chose`: the dtype and weights the run resolved (the report's fields; what `auto` picked)."""
    results = [{"phase": "decode", "batch": b, "tokens_per_s": v, "roofline_fraction": 0.25} for b, v in decode.items()]
    results.append({"phase": "prefill", "batch": 8, "tokens_per_s": prefill, "roofline_fraction": 0.7})
    (out / f"executor-{config}.json").write_text(json.dumps({"rss_mib": rss, "results": results, **chose}))


def _serve(out: Path, config: str, results: dict[str, tuple[float, float]]) -> None:
    rows = [
        {"configuration": name, "workload": "mixed", "output_throughput": tps, "ttft": {"mean": ttft}}
        for name, (tps, ttft) in results.items()
    ]
    (out / f"serve-{config}.json").write_text(json.dumps({"results": rows}))


def _fixture(tmp_path: Path, serving_ttft: float, default: bool = True) -> Path:
    """`default`: with the `--dtype auto --weights auto` run (here `auto` chose bfloat16, dequantized)."""
    _llama(tmp_path, {1: 90.0, 8: 160.0, 32: 150.0, 64: 130.0}, pp=270.0)
    if default:
        auto = {1: 25.0, 8: 130.0, 32: 450.0, 64: 700.0}
        _executor(tmp_path, "auto-auto", auto, prefill=2000.0, rss=900, dtype="bfloat16", weights="dequantized")
        _serve(tmp_path, "auto-auto", {"kvserve": (150.0, serving_ttft)})
    _executor(tmp_path, "float32-dequantized", {1: 18.0, 8: 100.0, 32: 310.0, 64: 200.0}, prefill=400.0, rss=1100)
    _executor(tmp_path, "float32-native", {1: 30.0, 8: 90.0, 32: 100.0, 64: 140.0}, prefill=200.0, rss=700)
    _serve(
        tmp_path,
        "float32-dequantized",
        {"kvserve": (60.0, serving_ttft), "llama-server": (30.0, 10.0), "hf-generate": (35.0, 20.0)},
    )
    (tmp_path / "llama-server.rss_kib").write_text("204800\n")
    return tmp_path


def test_the_verdict_is_the_default_configurations_with_the_best_other_beside(tmp_path: Path) -> None:
    rows = build_rows(_fixture(tmp_path, serving_ttft=5.0))
    assert [r.name.split(" (")[0] for r in rows] == [
        "llama.cpp",
        "kvserve default",
        "kvserve float32 --weights dequantized",
        "kvserve float32 --weights native",
        "HF transformers generate",
    ]
    assert rows[1].name == "kvserve default (`auto`: bfloat16 --weights dequantized)"
    verdicts = {line.split(" | ")[0].strip("| "): line for line in ratio_lines(rows)[2:]}
    # B=1: the default's 25 / 90 misses, though float32 native's 30 / 90 is the best other.
    assert "| 0.28× | **missed** | kvserve float32 --weights native: 0.33× |" in verdicts["decode B=1"]
    assert "| 3.00× | met | kvserve float32 --weights dequantized: 2.07× |" in verdicts["decode B=32"]  # 450 / 150
    assert "| 7.41× | met |" in verdicts["prefill"]  # 2000 / 270
    assert "| 5.00× | met | kvserve float32 --weights dequantized: 2.00× |" in verdicts["serving"]  # 150 / 30
    assert rows[0].rss_mib == 200.0


def test_without_the_default_run_the_verdict_says_so_and_shows_the_best(tmp_path: Path) -> None:
    rows = build_rows(_fixture(tmp_path, serving_ttft=5.0, default=False))
    line = next(line for line in ratio_lines(rows) if line.startswith("| decode B=32"))
    assert line == (
        "| decode B=32 | ≥ 2× | not measured | default not measured | kvserve float32 --weights dequantized: 2.07× |"
    )


def test_serving_is_missed_without_a_lower_mean_ttft(tmp_path: Path) -> None:
    rows = build_rows(_fixture(tmp_path, serving_ttft=12.0))
    serving = next(line for line in ratio_lines(rows) if line.startswith("| serving"))
    assert "| 5.00× | **missed** |" in serving


def test_the_table_prints_every_row_with_its_peak_fraction(tmp_path: Path, capsys) -> None:
    assert main([str(_fixture(tmp_path, serving_ttft=5.0))]) == 0
    table = capsys.readouterr().out
    assert "| kvserve float32 --weights dequantized | 18.0 (25%) | 100.0 (25%) | 310.0 (25%) |" in table
    assert "400.0 (70%) | 60.0 | 5.00 s | 1,100 MiB |" in table
    assert "unknown CPU" in table  # no lscpu.txt in the fixture


def test_b1_is_measured_against_one_physical_limit_for_both_engines(tmp_path: Path) -> None:
    """kvserve's fraction comes from its own report; llama.cpp's from the bytes its step reads of the
    GGUF at the copy bandwidth kvserve's run measured: 90 tok/s × 100 MB / 20 GB/s = 45%."""
    out = _fixture(tmp_path, serving_ttft=5.0)
    report = json.loads((out / "executor-float32-dequantized.json").read_text())
    report["copy_bandwidth"] = 20e9
    report["results"][0]["limit_fraction"] = 0.125
    (out / "executor-float32-dequantized.json").write_text(json.dumps(report))
    (out / "llama-bytes.json").write_text(json.dumps({"weight_bytes": 99_000_000, "kv_bytes_per_seq": 1_000_000}))
    rows = build_rows(out)
    assert abs(rows[0].limit_b1 - 0.45) < 1e-9
    assert next(r for r in rows if r.name == "kvserve float32 --weights dequantized").limit_b1 == 0.125


def _single(out: Path, ours: tuple[float, float, float], theirs: tuple[float, float, float]) -> None:
    rows = [
        {"configuration": name, "workload": "mixed", "output_throughput": tps, "itl": {"p50": p50, "p99": p99}}
        for name, (tps, p50, p99) in (("kvserve", ours), ("llama-server", theirs))
    ]
    (out / "serve-single.json").write_text(json.dumps({"results": rows}))


def test_a_single_stream_needs_llama_servers_throughput_and_a_steady_itl(tmp_path: Path, capsys) -> None:
    out = _fixture(tmp_path, serving_ttft=5.0)
    _single(out, ours=(100.0, 0.010, 0.014), theirs=(90.0, 0.011, 0.012))
    assert main([str(out)]) == 0
    table = capsys.readouterr().out
    assert "| kvserve (default configuration) | 100.0 | 10.0 ms | 14.0 ms |" in table
    assert "| single stream | ≥ 1× | 1.11× (ITL p99 1.40× p50) | met | – |" in table
    _single(out, ours=(100.0, 0.010, 0.016), theirs=(90.0, 0.011, 0.012))  # p99 1.6× p50: not steady
    assert main([str(out)]) == 0
    assert "| 1.11× (ITL p99 1.60× p50) | **missed** |" in capsys.readouterr().out
    (out / "serve-single.json").unlink()
    assert main([str(out)]) == 0
    assert "| single stream | ≥ 1× | – | not measured | – |" in capsys.readouterr().out
