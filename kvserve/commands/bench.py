"""`kvserve bench ...`: benchmarks, one module per target."""

from __future__ import annotations

import argparse
import importlib

BENCHES = (
    "kvserve.commands.bench_scheduler",
    "kvserve.commands.bench_executor",
    "kvserve.commands.bench_structured",
    "kvserve.commands.bench_quality",
    "kvserve.commands.bench_serve",
    "kvserve.commands.bench_baseline_hf",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.cli import HelpFormatter

    parser = subparsers.add_parser(
        "bench",
        help="run a benchmark (scheduler, executor, structured, quality, serve, baseline-hf)",
        description="Benchmarks. Each reports ratios against a baseline measured in the same run.",
        formatter_class=HelpFormatter,
    )
    benches = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name in BENCHES:
        importlib.import_module(name).register(benches)
