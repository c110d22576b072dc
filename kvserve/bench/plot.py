"""PNGs (matplotlib, Agg backend): latency percentiles and throughput per configuration
(`plot_results`), and a `--sweep`'s figures against the swept value (`plot_sweep`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "end-to-end"))
PERCENTILE_KEYS = ("p50", "p90", "p99")
SWEEP_PANELS = (
    ("output_throughput", "output tokens/s", 1.0),
    ("ttft_p50", "TTFT p50 (ms)", 1000.0),
    ("ttft_p99", "TTFT p99 (ms)", 1000.0),
    ("itl_p99", "ITL p99 (ms)", 1000.0),
    ("kv_waste_pct", "KV partial-block waste (%)", 1.0),
    ("peak_running", "peak running sequences", 1.0),
)
"""A sweep point's key, the panel's title, and the factor to its unit."""


def _value(x: Any) -> float:
    return x * 1000.0 if _finite(x) else 0.0


def plot_results(results: list[dict[str, Any]], path: str | Path, title: str = "kvserve bench serve") -> Path:
    """Five panels: four latency metrics (p50/p90/p99 bars in ms) and output tokens/s."""
    plt = _pyplot()
    labels = [f"{r['configuration']}\n{r['workload']}" for r in results]
    fig, axes = plt.subplots(1, len(PANELS) + 1, figsize=(4 * (len(PANELS) + 1), 4.5 + 0.15 * len(results)))
    positions = range(len(results))
    width = 0.8 / len(PERCENTILE_KEYS)
    for ax, (key, name) in zip(axes, PANELS):
        for i, pct in enumerate(PERCENTILE_KEYS):
            ax.barh(
                [p + i * width for p in positions], [_value(r[key].get(pct)) for r in results], height=width, label=pct
            )
        ax.set_title(f"{name} (ms)")
        ax.set_yticks([p + width for p in positions])
        ax.set_yticklabels(labels if key == PANELS[0][0] else [], fontsize=7)
        ax.invert_yaxis()
    axes[0].legend(fontsize=7)
    throughput_ax = axes[-1]
    throughput_ax.barh(list(positions), [_value(r["output_throughput"]) / 1000.0 for r in results], color="tab:green")
    throughput_ax.set_title("output tokens/s")
    throughput_ax.set_yticks(list(positions))
    throughput_ax.set_yticklabels([])
    throughput_ax.invert_yaxis()
    return _save(plt, fig, title, path)


def plot_sweep(sweep: dict[str, Any], path: str | Path, title: str = "kvserve bench serve --sweep") -> Path:
    """Six panels, one line per workload: each `SWEEP_PANELS` figure against the swept value
    (numeric values on a numeric axis, log2 when they span 4x or more; others evenly spaced)."""
    plt = _pyplot()
    values: list[str] = sweep["values"]
    try:
        xs = [float(v) for v in values]
    except ValueError:
        xs = [float(i) for i in range(len(values))]
    at = dict(zip(values, xs))
    log2 = all(x > 0 for x in xs) and max(xs) >= 4 * min(xs)
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    workloads = list(dict.fromkeys(p["workload"] for p in sweep["points"]))
    for ax, (key, name, scale) in zip(axes.flat, SWEEP_PANELS):
        for workload in workloads:
            points = [p for p in sweep["points"] if p["workload"] == workload]
            ys = [p[key] * scale if _finite(p[key]) else math.nan for p in points]
            ax.plot([at[p["value"]] for p in points], ys, marker="o", label=workload)
        if log2:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, values)
        ax.minorticks_off()
        ax.set_xlabel(f"--{sweep['flag']}")
        ax.set_title(name)
        ax.set_ylim(bottom=0)
    axes.flat[0].legend(fontsize=8)
    return _save(plt, fig, title, path)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, title: str, path: str | Path) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
