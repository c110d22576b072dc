"""`python -m kvserve.bench.cpu_table`: the one-run CPU table and its goal verdicts, from fixture files."""

from __future__ import annotations

import json
from pathlib import Path

from kvserve.bench.cpu_table import build_rows, main, ratio_lines


def _llama(out: Path, tg: dict[int, float], pp: float) -> None:
    lines = [json.dumps({"pl": b, "speed_tg": v, "speed_pp": pp}) for b, v in tg.items()]
    (out / "llama-batched.jsonl").write_text("\n".join(lines) + "\n")


def _executor(out: Path, config: str, decode: dict[int, float], prefill: float, rss: float) -> None:
    results = [{"phase": "decode", "batch": b, "tokens_per_s": v, "roofline_fraction": 0.25} for b, v in decode.items()]
    results.append({"phase": "prefill", "batch": 8, "tokens_per_s": prefill, "roofline_fraction": 0.7})
    (out / f"executor-{config}.json").write_text(json.dumps({"rss_mib": rss, "results": results}))


def _serve(out: Path, config: str, results: dict[str, tuple[float, float]]) -> None:
    rows = [
        {"configuration": name, "workload": "mixed", "output_throughput": tps, "ttft": {"mean": ttft}}
        for name, (tps, ttft) in results.items()
    ]
    (out / f"serve-{config}.json").write_text(json.dumps({"results": rows}))


def _fixture(tmp_path: Path, serving_ttft: float) -> Path:
    _llama(tmp_path, {1: 90.0, 8: 160.0, 32: 150.0, 64: 130.0}, pp=270.0)
    _executor(tmp_path, "float32-dequantized", {1: 18.0, 8: 100.0, 32: 310.0, 64: 200.0}, prefill=400.0, rss=1100)
    _executor(tmp_path, "float32-native", {1: 30.0, 8: 90.0, 32: 100.0, 64: 140.0}, prefill=200.0, rss=700)
    _serve(
        tmp_path,
        "float32-dequantized",
        {"kvserve": (60.0, serving_ttft), "llama-server": (30.0, 10.0), "hf-generate": (35.0, 20.0)},
    )
    (tmp_path / "llama-server.rss_kib").write_text("204800\n")
    return tmp_path


def test_each_goal_takes_the_best_kvserve_configuration(tmp_path: Path) -> None:
    rows = build_rows(_fixture(tmp_path, serving_ttft=5.0))
    assert [r.name.split(" (")[0] for r in rows] == [
        "llama.cpp",
        "kvserve float32 --weights dequantized",
        "kvserve float32 --weights native",
        "HF transformers generate",
    ]
    verdicts = {line.split(" | ")[0].strip("| "): line for line in ratio_lines(rows)[2:]}
    assert "float32 --weights native | 0.33× | **missed**" in verdicts["decode B=1"]
    assert "0.62× | **missed**" in verdicts["decode B=8"]
    assert "2.07× | met" in verdicts["decode B=32"]  # 310 / 150
    assert "1.48× | **missed**" in verdicts["prefill"]
    assert "2.00× | met" in verdicts["serving"]
    assert rows[0].rss_mib == 200.0


def test_serving_is_missed_without_a_lower_mean_ttft(tmp_path: Path) -> None:
    rows = build_rows(_fixture(tmp_path, serving_ttft=12.0))
    serving = next(line for line in ratio_lines(rows) if line.startswith("| serving"))
    assert "2.00× | **missed**" in serving


def test_the_table_prints_every_row_with_its_peak_fraction(tmp_path: Path, capsys) -> None:
    assert main([str(_fixture(tmp_path, serving_ttft=5.0))]) == 0
    table = capsys.readouterr().out
    assert "| kvserve float32 --weights dequantized | 18.0 (25%) | 100.0 (25%) | 310.0 (25%) |" in table
    assert "400.0 (70%) | 60.0 | 5.00 s | 1,100 MiB |" in table
    assert "unknown CPU" in table  # no lscpu.txt in the fixture
