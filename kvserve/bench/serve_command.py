"""`kvserve bench serve` (`register`, `run`): the flags in, `run_serve_benchmark`, the report out.

`run` checks what it can before any server starts (`--target` specs, the `--sweep` spec), then
writes the report where `ReportOutput`'s flags say; an unmeasured `--target` makes the exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import sys

from kvserve.bench.openai_driver import HttpTarget
from kvserve.bench.report_output import ReportOutput, write_outputs
from kvserve.bench.serve import run_serve_benchmark
from kvserve.bench.serve_config import BenchConfig
from kvserve.bench.sweep import SweepSpec
from kvserve.config.flags import HelpFormatter, add_flags, config_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serving benchmark: latency, throughput, cache reuse, ratios vs baselines",
        description="Drive a kvserve server (or start one) with seeded workloads, through the gRPC async "
        "client or (--api openai) its OpenAI-compatible HTTP API, then compare, in the same run, kvserve "
        "with prefix caching off, any other OpenAI-compatible server (--target, e.g. llama.cpp's "
        "llama-server), Hugging Face generate (static batching) and contiguous preallocation (run for real "
        "with --start-server, and estimated). Prints a table and the goal ratios of docs/benchmarks.md; "
        "--json and --plot write them for machines and people. --sweep FLAG=V1,V2,... instead runs the "
        "workload once per value of a kvserve serve flag, each on a fresh server.",
        formatter_class=HelpFormatter,
    )
    add_flags(parser, BenchConfig, exclude=("command_line",))
    add_flags(parser, ReportOutput, overrides={"json": {"help": ReportOutput.JSON_HELP + ", table to stderr"}})
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.log_config import configure_logging

    configure_logging()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request of the HTTP driver
    config = config_from_args(BenchConfig, args, command_line=shlex.join(["kvserve", *sys.argv[1:]]))
    try:
        for spec in config.targets:
            HttpTarget.parse(spec)
        if config.sweep is not None:
            SweepSpec.parse(config.sweep).check()  # before any server starts
    except ValueError as exc:
        print(f"kvserve bench serve: {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(run_serve_benchmark(config))
    status = write_outputs(report, config_from_args(ReportOutput, args), stream=sys.stdout)
    unmeasured = [name for name, meta in report.meta.get("targets", {}).items() if meta.get("error")]
    for name in unmeasured:
        print(
            f"kvserve bench serve: --target {name} not measured: {report.meta['targets'][name]['error']}",
            file=sys.stderr,
        )
    return 1 if unmeasured else status
