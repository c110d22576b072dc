"""`kvserve bench ...`: the benchmarks, each one module of `kvserve.bench` with its own `register`."""

from __future__ import annotations

import argparse
import importlib

BENCHES = (
    "kvserve.bench.scheduler",
    "kvserve.bench.executor_command",
    "kvserve.bench.structured",
    "kvserve.bench.quality",
    "kvserve.bench.serve_command",
    "kvserve.bench.baseline_hf",
    "kvserve.bench.overload",
    "kvserve.bench.viewers",
    "kvserve.bench.scale_out",
    "kvserve.bench.speculative",
    "kvserve.bench.prefix_tiers",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.cli import HelpFormatter

    parser = subparsers.add_parser(
        "bench",
        help="run a benchmark (scheduler, executor, structured, quality, serve, baseline-hf, overload, viewers, "
        "scale-out, speculative, prefix-tiers)",
        description="Benchmarks. Each reports ratios against a baseline measured in the same run.",
        formatter_class=HelpFormatter,
    )
    benches = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name in BENCHES:
        importlib.import_module(name).register(benches)
