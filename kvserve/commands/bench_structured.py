"""`kvserve bench structured`: decode step time with structured output against free text, same run."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from kvserve.config import defaults

GOAL_OVERHEAD = 0.10
"""The project's goal: a step whose rows are all constrained costs at most 10% more than a free one."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.cli import HelpFormatter

    parser = subparsers.add_parser(
        "structured",
        help="decode step time with every row under a JSON schema, against free text",
        description="Runs the scheduler (llguidance bitmasks), the wire codec and the model runner\n"
        "in one process, decoding the same chat prompts twice at each batch size: free\n"
        "text, then every row under a JSON schema. Prints the median step time of each,\n"
        "split into scheduling, wire, execution and update, and the overhead ratio.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--model", default=defaults.DEFAULT_MODEL, help="the default model name, an HF model directory, or a .gguf file"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="decode batch sizes")
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per run (medians are reported)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="free/constrained run pairs, interleaved; the median counts"
    )
    parser.add_argument("--kv-cache-gb", type=float, default=0.5, help="KV budget of the runner")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.structured_bench import run_structured_bench
    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.runner_config import RunnerConfig
    from kvserve.log_config import configure_logging
    from kvserve.scheduler.server.tokenizer import Tokenizer

    configure_logging(level="WARNING" if args.json else None)
    runner = ModelRunner(
        RunnerConfig(model=args.model, device=args.device, kv_cache_gb=args.kv_cache_gb, num_threads=args.num_threads)
    )
    tokenizer = Tokenizer.from_dir(runner.info().tokenizer_path)
    results = run_structured_bench(
        runner, tokenizer, args.batches, args.steps, args.repeats, progress=(lambda _l: None) if args.json else print
    )
    if args.json:
        print(json.dumps([{**asdict(r), "overhead": r.overhead} for r in results]))
        return 0
    print(f"{'batch':>5}  {'free ms/step':>12}  {'constrained':>11}  {'overhead':>8}   constrained split (ms)")
    for r in results:
        c = r.constrained
        print(
            f"{r.batch:5d}  {r.free.total_ms:12.2f}  {c.total_ms:11.2f}  {100 * r.overhead:7.1f}%   "
            f"schedule {c.schedule_ms:.2f} (free {r.free.schedule_ms:.2f}), wire {c.wire_ms:.2f}, "
            f"execute {c.execute_ms:.2f} (free {r.free.execute_ms:.2f}), update {c.update_ms:.2f}"
        )
        print(
            f"       tokens/s: free {1e3 * r.batch / r.free.total_ms:.1f}, constrained {1e3 * r.batch / c.total_ms:.1f}"
        )
    print(f"goal: constrained steps cost at most {100 * GOAL_OVERHEAD:.0f}% more")
    runner.close()
    return 0
