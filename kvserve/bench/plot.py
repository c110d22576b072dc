"""A PNG of latency percentiles and throughput per configuration (matplotlib, Agg backend)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "end-to-end"))
PERCENTILE_KEYS = ("p50", "p90", "p99")


def _value(x: Any) -> float:
    return x * 1000.0 if isinstance(x, (int, float)) and math.isfinite(x) else 0.0


def plot_results(results: list[dict[str, Any]], path: str | Path, title: str = "kvserve bench serve") -> Path:
    """Five panels: four latency metrics (p50/p90/p99 bars in ms) and output tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
