"""The CPU table of docs/benchmarks.md from one run of `scripts/bench_cpu_table.sh`.

    python -m kvserve.bench.cpu_table OUT_DIR

reads what the script left in OUT_DIR (llama.cpp's batched-bench JSON lines, one
`kvserve bench executor --json` per configuration, `bench serve --json` reports, RSS
files, the bytes a llama.cpp step reads) and prints the markdown: tokens/s per batch size,
prefill, serving `mixed`, RSS, B=1 against the physical limit, single-stream serving, then
each goal ratio against llama.cpp with met or missed. Every figure in one table comes
from the same run on the same machine, so the ratios compare like with like.

The verdict is the **default** configuration's: users run `--dtype auto --weights auto`, so the
script measures it as a configuration of its own (`auto-auto`, whose report names what `auto`
chose), and each goal's line shows the best other configuration beside it. A run without it (older
output directories) says the default was not measured and shows the best configuration only.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DECODE_BATCHES = (1, 8, 32, 64)
PREFILL_BATCH = 8
"""Prefill is compared at 8 prompts of 128 tokens in one batch (llama.cpp: pp 128, npl 8)."""
DEFAULT_CONFIG = "auto-auto"
"""`--dtype auto --weights auto`: what users run, and what the verdicts judge."""
CONFIGS = (DEFAULT_CONFIG, "float32-dequantized", "float32-native", "bfloat16-dequantized")
GOALS = {
    "decode B=1": 1.0, "decode B=8": 1.5, "decode B=32": 2.0, "decode B=64": 2.0, "prefill": 2.0, "serving": 2.0,
    "single stream": 1.0,
}  # fmt: skip
"""kvserve ÷ llama.cpp (serving also needs a lower mean TTFT; a single stream an ITL p99 ≤ 1.5× its p50)."""
SINGLE_STREAM_ITL_SPREAD = 1.5


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
    limit_b1: float | None = None
    """Decode B=1 as a fraction of its physical limit (`kvserve.bench.physical_limit`)."""
    default: bool = False
    """The `--dtype auto --weights auto` run: the verdicts are its."""


@dataclass(slots=True)
class SingleStream:
    """One server's `bench serve --concurrency 1` figures."""

    name: str
    output_tokens_per_s: float
    itl_p50: float
    itl_p99: float


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
    default = config == DEFAULT_CONFIG
    chose = f"{report.get('dtype', '?')} --weights {report.get('weights', '?')}"
    return Row(
        name=f"kvserve default (`auto`: {chose})" if default else f"kvserve {config.replace('-', ' --weights ', 1)}",
        default=default,
        decode={b: r["tokens_per_s"] for b, r in decode.items()},
        prefill=prefill[PREFILL_BATCH]["tokens_per_s"] if PREFILL_BATCH in prefill else None,
        roofline=roofline,
        rss_mib=report.get("rss_mib"),
        limit_b1=decode[1].get("limit_fraction") if 1 in decode else None,
    )


def llama_limit_b1(out: Path, llama: Row) -> float | None:
    """llama.cpp's B=1 against the same limit: the bytes its step reads of the GGUF
    (`llama-bytes.json`) at the copy bandwidth the first kvserve run that reports one measured."""
    from kvserve.bench.physical_limit import limit_tokens_per_s

    path = out / "llama-bytes.json"
    reports = [out / f"executor-{c}.json" for c in CONFIGS if (out / f"executor-{c}.json").exists()]
    if not path.exists() or not reports or 1 not in llama.decode:
        return None
    read = json.loads(path.read_text())
    bandwidth = next((b for r in reports if (b := json.loads(r.read_text()).get("copy_bandwidth"))), None)
    if not bandwidth:
        return None
    return llama.decode[1] / limit_tokens_per_s(bandwidth, read["weight_bytes"], read["kv_bytes_per_seq"], 1)


def single_stream(out: Path) -> list[SingleStream]:
    """kvserve's default configuration and llama-server with one slot, at concurrency 1 (`serve-single.json`)."""
    path = out / "serve-single.json"
    if not path.exists():
        return []
    names = {"kvserve": "kvserve (default configuration)", "llama-server": "llama-server (1 slot)"}
    return [
        SingleStream(names[r["configuration"]], r["output_throughput"], r["itl"]["p50"], r["itl"]["p99"])
        for r in json.loads(path.read_text())["results"]
        if r["configuration"] in names
    ]


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
    llama.limit_b1 = llama_limit_b1(out, llama)
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


def render(rows: list[Row], cpu: str, single: list[SingleStream] | None = None) -> str:
    head = ["configuration", *[f"decode B={b}" for b in DECODE_BATCHES], f"prefill 128×{PREFILL_BATCH}"]
    head += ["serving `mixed` out tok/s", "mean TTFT", "RSS"]
    lines = [f"Machine: {cpu}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row.name, *[_fmt(row.decode.get(b), row.roofline.get(f"decode B={b}")) for b in DECODE_BATCHES]]
        cells += [_fmt(row.prefill, row.roofline.get("prefill")), _fmt(row.serving)]
        cells += [f"{row.ttft_mean:.2f} s" if row.ttft_mean else "–", f"{row.rss_mib:,.0f} MiB" if row.rss_mib else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Tokens/s; in brackets the fraction of the same run's GEMM peak in that row's dtype.", ""]
    limits = [f"{r.name}: {100 * r.limit_b1:.0f}%" for r in rows if r.limit_b1 is not None]
    if limits:
        lines += ["Decode B=1 as a fraction of its physical limit (every weight read once at the copy bandwidth):"]
        lines += ["; ".join(limits) + ".", ""]
    if single:
        lines += ["| single stream (concurrency 1) | output tok/s | ITL p50 | ITL p99 |", "|---|---|---|---|"]
        lines += [
            f"| {s.name} | {s.output_tokens_per_s:.1f} | {1e3 * s.itl_p50:.1f} ms | {1e3 * s.itl_p99:.1f} ms |"
            for s in single
        ]
        lines.append("")
    lines += ratio_lines(rows, single or [])
    return "\n".join(lines)


def ratio_lines(rows: list[Row], single: Sequence[SingleStream] = ()) -> list[str]:
    """For each goal, the default configuration's ratio to llama.cpp (the verdict), and the best other's."""
    llama, ours = rows[0], [r for r in rows[1:] if r.name.startswith("kvserve")]
    default = next((r for r in ours if r.default), None)
    lines = [
        "| goal (kvserve ÷ llama.cpp) | target | default configuration | verdict | best other configuration |",
        "|---|---|---|---|---|",
    ]
    for goal, target in GOALS.items():
        if goal == "single stream":
            lines.append(_single_stream_line(single, target))
            continue
        base = _goal_value(llama, goal)
        if not base:
            lines.append(f"| {goal} | ≥ {target:g}× | – | not measured | – |")
            continue
        others = [(value / base, r) for r in ours if not r.default and (value := _goal_value(r, goal))]
        best = max(others, key=lambda c: c[0], default=None)
        beside = f"{best[1].name}: {best[0]:.2f}×" if best else "–"
        value = _goal_value(default, goal) if default is not None else None
        if not value or default is None:
            lines.append(f"| {goal} | ≥ {target:g}× | not measured | default not measured | {beside} |")
            continue
        ratio = value / base
        met = ratio >= target
        if goal == "serving" and met:
            met = bool(default.ttft_mean and llama.ttft_mean and default.ttft_mean < llama.ttft_mean)
        lines.append(f"| {goal} | ≥ {target:g}× | {ratio:.2f}× | {'met' if met else '**missed**'} | {beside} |")
    return lines


def _single_stream_line(single: Sequence[SingleStream], target: float) -> str:
    ours = next((s for s in single if s.name.startswith("kvserve")), None)
    theirs = next((s for s in single if s.name.startswith("llama")), None)
    if ours is None or theirs is None or not theirs.output_tokens_per_s:
        return f"| single stream | ≥ {target:g}× | – | not measured | – |"
    ratio = ours.output_tokens_per_s / theirs.output_tokens_per_s
    steady = ours.itl_p99 <= SINGLE_STREAM_ITL_SPREAD * ours.itl_p50
    met = ratio >= target and steady
    spread = f"ITL p99 {ours.itl_p99 / ours.itl_p50:.2f}× p50" if ours.itl_p50 else "no ITL"
    verdict = "met" if met else "**missed**"
    return f"| single stream | ≥ {target:g}× | {ratio:.2f}× ({spread}) | {verdict} | – |"


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
    print(render(build_rows(out), _cpu(out), single_stream(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
