"""The CPU table of docs/benchmarks.md from one run of `scripts/bench_cpu_table.sh`.

    python -m kvserve.bench.cpu_table OUT_DIR

reads what the script left in OUT_DIR (llama.cpp's batched-bench JSON lines, one
`kvserve bench executor --json` per configuration, `bench serve --json` reports, RSS
files) and prints the markdown: tokens/s per batch size, prefill, serving `mixed`, RSS,
then each goal ratio against llama.cpp with met or missed. Every figure in one table comes
from the same run on the same machine, so the ratios compare like with like.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DECODE_BATCHES = (1, 8, 32, 64)
PREFILL_BATCH = 8
"""Prefill is compared at 8 prompts of 128 tokens in one batch (llama.cpp: pp 128, npl 8)."""
CONFIGS = ("float32-dequantized", "float32-native", "bfloat16-dequantized")
GOALS = {"decode B=1": 1.0, "decode B=8": 1.5, "decode B=32": 2.0, "decode B=64": 2.0, "prefill": 2.0, "serving": 2.0}
"""kvserve ÷ llama.cpp, issue 12's goals (serving also needs a lower mean TTFT)."""


@dataclass(slots=True)
class Row:
    name: str
    decode: dict[int, float]
    prefill: float | None
    roofline: dict[str, float]
    """Fraction of the same run's GEMM peak in the row's dtype, by column."""
    serving: float | None = None
    ttft_mean: float | None = None
    rss_mib: float | None = None


def llama_row(out: Path) -> Row:
    rows = [json.loads(line) for line in (out / "llama-batched.jsonl").read_text().splitlines() if line.strip()]
    by_pl = {r["pl"]: r for r in rows}
    rss = _read_float(out / "llama-batched.rss_kib")
    return Row(
        name="llama.cpp (Q4_1, llama-batched-bench / llama-server)",
        decode={b: by_pl[b]["speed_tg"] for b in DECODE_BATCHES if b in by_pl},
        prefill=by_pl[PREFILL_BATCH]["speed_pp"] if PREFILL_BATCH in by_pl else None,
        roofline={},
        rss_mib=rss / 1024 if rss else None,
    )


def kvserve_row(out: Path, config: str) -> Row | None:
    path = out / f"executor-{config}.json"
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    decode = {r["batch"]: r for r in report["results"] if r["phase"] == "decode"}
    prefill = {r["batch"]: r for r in report["results"] if r["phase"] == "prefill"}
    roofline = {f"decode B={b}": decode[b]["roofline_fraction"] for b in decode}
    if PREFILL_BATCH in prefill:
        roofline["prefill"] = prefill[PREFILL_BATCH]["roofline_fraction"]
    return Row(
        name=f"kvserve {config.replace('-', ' --weights ', 1)}",
        decode={b: r["tokens_per_s"] for b, r in decode.items()},
        prefill=prefill[PREFILL_BATCH]["tokens_per_s"] if PREFILL_BATCH in prefill else None,
        roofline=roofline,
        rss_mib=report.get("rss_mib"),
    )


def serving(out: Path, name: str, configuration: str) -> tuple[float, float] | None:
    """(output tok/s, mean TTFT s) of `configuration` on `mixed` in the report `serve-NAME.json`."""
    path = out / f"serve-{name}.json"
    if not path.exists():
        return None
    for result in json.loads(path.read_text())["results"]:
        if result["configuration"] == configuration and result["workload"] == "mixed":
            return result["output_throughput"], result["ttft"]["mean"]
    return None


def build_rows(out: Path) -> list[Row]:
    llama = llama_row(out)
    served = serving(out, "float32-dequantized", "llama-server")
    if served:
        llama.serving, llama.ttft_mean = served
    llama.rss_mib = _read_float(out / "llama-server.rss_kib") / 1024 or llama.rss_mib
    rows = [llama]
    for config in CONFIGS:
        row = kvserve_row(out, config)
        if row is None:
            continue
        served = serving(out, config, "kvserve")
        if served:
            row.serving, row.ttft_mean = served
        rows.append(row)
    hf = serving(out, "float32-dequantized", "hf-generate")
    if hf:
        rows.append(Row("HF transformers generate (fp32, static batches of 8)", {}, None, {}, hf[0], hf[1]))
    return rows


def render(rows: list[Row], cpu: str) -> str:
    head = ["configuration", *[f"decode B={b}" for b in DECODE_BATCHES], f"prefill 128×{PREFILL_BATCH}"]
    head += ["serving `mixed` out tok/s", "mean TTFT", "RSS"]
    lines = [f"Machine: {cpu}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row.name, *[_fmt(row.decode.get(b), row.roofline.get(f"decode B={b}")) for b in DECODE_BATCHES]]
        cells += [_fmt(row.prefill, row.roofline.get("prefill")), _fmt(row.serving)]
        cells += [f"{row.ttft_mean:.2f} s" if row.ttft_mean else "–", f"{row.rss_mib:,.0f} MiB" if row.rss_mib else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Tokens/s; in brackets the fraction of the same run's GEMM peak in that row's dtype.", ""]
    lines += ratio_lines(rows)
    return "\n".join(lines)


def ratio_lines(rows: list[Row]) -> list[str]:
    """For each goal, the best kvserve configuration's ratio to llama.cpp."""
    llama, ours = rows[0], [r for r in rows[1:] if r.name.startswith("kvserve")]
    lines = [
        "| goal (kvserve ÷ llama.cpp) | target | best kvserve configuration | ratio | verdict |",
        "|---|---|---|---|---|",
    ]
    for goal, target in GOALS.items():
        base = _goal_value(llama, goal)
        candidates = [(_goal_value(r, goal), r) for r in ours if _goal_value(r, goal) and base]
        if not candidates or base is None:
            lines.append(f"| {goal} | ≥ {target:g}× | – | – | not measured |")
            continue
        best, row = max(candidates, key=lambda c: c[0] or 0.0)
        assert best is not None
        ratio = best / base
        met = ratio >= target
        if goal == "serving" and met:
            met = bool(row.ttft_mean and llama.ttft_mean and row.ttft_mean < llama.ttft_mean)
        lines.append(f"| {goal} | ≥ {target:g}× | {row.name} | {ratio:.2f}× | {'met' if met else '**missed**'} |")
    return lines


def _goal_value(row: Row, goal: str) -> float | None:
    if goal == "prefill":
        return row.prefill
    if goal == "serving":
        return row.serving
    return row.decode.get(int(goal.split("=")[1]))


def _fmt(value: float | None, fraction: float | None = None) -> str:
    if value is None:
        return "–"
    return f"{value:.1f}" + (f" ({100 * fraction:.0f}%)" if fraction is not None else "")


def _read_float(path: Path) -> float:
    try:
        return float(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0.0


def _cpu(out: Path) -> str:
    info: dict[str, Any] = {}
    for line in (out / "lscpu.txt").read_text().splitlines() if (out / "lscpu.txt").exists() else []:
        key, _, val = line.partition(":")
        info[key.strip()] = val.strip()
    flags = set(info.get("Flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16") if f in flags]
    return f"{info.get('Model name', 'unknown CPU')}, {info.get('CPU(s)', '?')} CPUs, flags: {', '.join(isa) or 'none'}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(args[0])
    print(render(build_rows(out), _cpu(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
