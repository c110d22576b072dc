"""CUDA graphs and torch.compile: their speedup is measured only where the executor uses them.

A scan of the executor's and the kernels' sources decides. Today it finds neither, so the
report says "not used" (the runner launches every kernel eagerly each step; at small decode
batches that launch overhead is part of what decode_throughput measures). When a scan finds
one, this check fails on purpose, naming where, until it is taught to measure the speedup.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.gpu_check.results import Outcome

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import CheckContext

PATTERNS = {
    "cuda graphs": re.compile(r"torch\.cuda\.graph\b|CUDAGraph|make_graphed_callables|cuda_graph"),
    "torch.compile": re.compile(r"torch\.compile\b|torch\._dynamo|reduce-overhead"),
}
SCANNED = ("executor_svc", "kernels")


def find_uses(repo: Path) -> dict[str, list[str]]:
    """`kind -> ["path:line", ...]` of every use in the scanned packages (comments included: a
    mention in a comment is worth a look too)."""
    found: dict[str, list[str]] = {kind: [] for kind in PATTERNS}
    for package in SCANNED:
        for path in sorted((repo / package).rglob("*.py")):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                for kind, pattern in PATTERNS.items():
                    if pattern.search(line):
                        found[kind].append(f"{path.relative_to(repo)}:{number}")
    return found


def measure_graph_usage(ctx: CheckContext) -> Outcome:
    uses = find_uses(ctx.repo)
    files = sum(1 for package in SCANNED for _ in (ctx.repo / package).rglob("*.py"))
    figures = {"scanned_files": files, "uses": uses}
    used = [kind for kind, where in uses.items() if where]
    if not used:
        row = ("CUDA graphs / torch.compile speedup", "executor", "not used", "-", "-")
        return Outcome(True, "not used: the executor runs eagerly (no CUDA graphs, no torch.compile)", figures, [row])
    where = "; ".join(f"{kind}: {', '.join(uses[kind][:3])}" for kind in used)
    return Outcome(
        False,
        f"the executor now uses {', '.join(used)} ({where}): teach this check to measure the speedup",
        figures,
        error="speedup not measured",
    )
