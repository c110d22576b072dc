"""`kvserve bench scheduler`: scheduler overhead per step, with no executor in the loop."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

DEFAULT_RUNNING = (64, 256, 1024)
GOAL_US_AT_256 = 1000.0
"""The goal in docs/benchmarks.md: schedule() + update() at 256 running decodes."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.cli import HelpFormatter

    parser = subparsers.add_parser(
        "scheduler",
        help="time schedule() + update() per step at many running sequences",
        description="Runs the scheduler alone, feeding sampled tokens straight back, once every\n"
        "sequence decodes. Prefix sharing on: 75% of each prompt is shared and the prefix\n"
        "cache is on; off: unique prompts, prefix cache off.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--running", type=int, nargs="+", default=list(DEFAULT_RUNNING), help="running-sequence counts to measure"
    )
    parser.add_argument("--prompt-len", type=int, default=300, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per configuration")
    parser.add_argument(
        "--prefix-sharing",
        choices=("both", "on", "off"),
        default="both",
        help="measure with a shared prompt prefix (and the prefix cache), without, or both",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print a JSON list of {running, prefix_sharing, us_per_step, us_per_seq, ...}",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.scheduler_overhead import run_scheduler_bench

    sharing = {"both": (False, True), "on": (True,), "off": (False,)}[args.prefix_sharing]
    results = []
    for running in args.running:
        for prefix_sharing in sharing:
            result = run_scheduler_bench(running, prefix_sharing, args.prompt_len, args.steps)
            results.append(result)
            if not args.json:
                print(
                    f"running {running:5d}  prefix sharing {'on ' if prefix_sharing else 'off'}  "
                    f"{result.us_per_step:8.1f} us/step (median {result.us_per_step_median:7.1f})  "
                    f"{result.us_per_seq:6.2f} us/seq  "
                    f"[schedule {result.us_schedule:.0f} us, update {result.us_update:.0f} us]",
                    flush=True,
                )
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
    else:
        print(f"goal: <= {GOAL_US_AT_256:.0f} us/step at 256 running sequences")
    return 0
