"""`kvserve bench serve`: kvserve against its baselines on the same requests, in one run."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, TextIO

from kvserve.config import defaults

if TYPE_CHECKING:
    from kvserve.bench.report import BenchReport

WORKLOAD_CHOICES = ("mixed", "shared-prefix", "multi-turn", "cold-warm", "all")


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.cli import HelpFormatter

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
    parser.add_argument(
        "--workload",
        choices=WORKLOAD_CHOICES,
        default="mixed",
        help="mixed: 64-512 prompt, 32-256 output; shared-prefix: 1,500-token system prompt + "
        "50-300-token questions; multi-turn: chats up to 10 turns; cold-warm: the "
        "shared-prefix requests on an empty then a primed cache; all: every one",
    )
    parser.add_argument("--num-requests", type=int, default=32, help="requests per workload")
    parser.add_argument("--concurrency", type=int, default=16, help="most requests in flight (0: no limit)")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrival rate in requests/s (inf: all arrive at once)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the workloads and the arrivals")
    parser.add_argument(
        "--max-tokens-cap",
        type=int,
        default=0,
        help="cap every request's max_tokens (0: the workload's own lengths); for short CPU runs",
    )
    parser.add_argument(
        "--start-server",
        action="store_true",
        help="start kvserve serve (and the no-cache server) as subprocesses on free ports",
    )
    parser.add_argument(
        "--executor", choices=("torch", "fake"), default="torch", help="executor of the started servers"
    )
    parser.add_argument(
        "--server-arg",
        dest="server_args",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument passed to every started server, e.g. --server-arg=--num-blocks=512",
    )
    parser.add_argument("--host", default=defaults.GRPC_HOST, help="server host (started servers listen here too)")
    parser.add_argument("--port", type=int, default=defaults.GRPC_PORT, help="port of an already running server")
    parser.add_argument(
        "--api",
        choices=("grpc", "openai"),
        default="grpc",
        help="how kvserve is driven: grpc (the async client) or openai (streaming /v1/completions on its "
        "HTTP API, the fair side of a comparison with --target); server counters come from gRPC either way",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=defaults.HTTP_PORT,
        help="with --api openai and no --start-server: the HTTP port of the already running server on --host",
    )
    parser.add_argument(
        "--target",
        dest="targets",
        action="append",
        default=[],
        metavar="NAME=URL[,tokens|,text]",
        help="another OpenAI-compatible server measured in the same run with the same requests, after "
        "kvserve's servers have stopped (repeatable), e.g. llama-server=http://127.0.0.1:8080 (see "
        "scripts/llama_server.sh). Prompts go as token ids, or as text decoded with the model's tokenizer; "
        "default: probe on the warm-up request. Every workload but cold-warm",
    )
    parser.add_argument(
        "--no-cache-target",
        default=None,
        metavar="HOST:PORT",
        help="an already running server with --no-prefix-caching; when unset, one is "
        "started with --start-server, else that baseline is skipped",
    )
    parser.add_argument(
        "--baselines",
        nargs="*",
        choices=("hf", "no-cache", "prealloc"),
        default=["hf", "no-cache", "prealloc"],
        help="baselines to run in the same run; prealloc: the contiguous-preallocation estimate, and with "
        "--start-server a server run for real with --kv-reservation max-model-len --no-prefix-caching "
        "(--max-model-len = each workload's longest request), shown as three tiers with the two paged ones",
    )
    parser.add_argument(
        "--sweep",
        default=None,
        metavar="FLAG=V1,V2,...",
        help="run the workload once per value of one kvserve serve flag, each on a fresh server started "
        "with --FLAG V (after every --server-arg), e.g. block-size=8,16,32; prints one table of output "
        "tok/s, TTFT p50/p99, ITL p99, KV partial-block waste and peak running against the value (--json, "
        "--plot too). Starts its servers itself; baselines and --target do not run",
    )
    parser.add_argument(
        "--model",
        default=defaults.DEFAULT_MODEL,
        help="model the hf baseline loads; its tokenizer also decodes text prompts for --target",
    )
    parser.add_argument("--hf-batch-size", type=int, default=8, help="static batch size of the hf baseline")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="write the JSON report to PATH (no PATH or '-': stdout, table to stderr)",
    )
    parser.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of latencies and throughput")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--startup-timeout", type=float, default=180.0, help="seconds to wait for SERVING")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import math
    import shlex
    import sys

    from kvserve.bench.openai_driver import HttpTarget
    from kvserve.bench.serve_benchmark import BenchConfig, run_serve_benchmark
    from kvserve.bench.sweep import SweepSpec
    from kvserve.bench.workloads import WORKLOAD_NAMES
    from kvserve.log_config import configure_logging

    configure_logging()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request of the HTTP driver
    try:
        for spec in args.targets:
            HttpTarget.parse(spec)
        if args.sweep is not None:
            SweepSpec.parse(args.sweep).check()  # before any server starts
    except ValueError as exc:
        print(f"kvserve bench serve: {exc}", file=sys.stderr)
        return 2
    config = BenchConfig(
        workloads=list(WORKLOAD_NAMES) if args.workload == "all" else [args.workload],
        num_requests=args.num_requests,
        concurrency=args.concurrency or None,
        request_rate=None if math.isinf(args.request_rate) else args.request_rate,
        seed=args.seed,
        max_tokens_cap=args.max_tokens_cap or None,
        start_server=args.start_server,
        executor=args.executor,
        host=args.host,
        port=args.port,
        server_args=list(args.server_args),
        no_cache_target=args.no_cache_target,
        baselines=list(args.baselines),
        model=args.model,
        hf_batch_size=args.hf_batch_size,
        progress=not args.no_progress,
        startup_timeout_s=args.startup_timeout,
        api=args.api,
        http_port=args.http_port,
        targets=list(args.targets),
        sweep=args.sweep,
        command_line=shlex.join(["kvserve", *sys.argv[1:]]),
    )
    report = asyncio.run(run_serve_benchmark(config))
    status = write_outputs(report, json_path=args.json, plot_path=args.plot, stream=sys.stdout)
    unmeasured = [name for name, meta in report.meta.get("targets", {}).items() if meta.get("error")]
    for name in unmeasured:
        print(
            f"kvserve bench serve: --target {name} not measured: {report.meta['targets'][name]['error']}",
            file=sys.stderr,
        )
    return 1 if unmeasured else status


def write_outputs(report: BenchReport, *, json_path: str | None, plot_path: str | None, stream: TextIO) -> int:
    """Table (stderr when the JSON goes to stdout), JSON, plot; a sweep's own table and plot.
    Shared with `bench baseline-hf`."""
    import sys
    from pathlib import Path

    from kvserve.bench.report import render_table
    from kvserve.bench.sweep import render_sweep_table

    table_stream = sys.stderr if json_path == "-" else stream
    print(render_table(report) if report.sweep is None else render_sweep_table(report.sweep), file=table_stream)
    if json_path == "-":
        print(report.to_json(), file=stream)
    elif json_path:
        Path(json_path).write_text(report.to_json() + "\n")
        print(f"json: {json_path}", file=table_stream)
    if plot_path:
        from kvserve.bench.plot import plot_results, plot_sweep

        print(f"plot: {plot_path}", file=table_stream)
        if report.sweep is None:
            plot_results(report.results, plot_path)
        else:
            plot_sweep(report.sweep, plot_path)
    return 1 if any(r["num_failed"] for r in report.results) else 0
