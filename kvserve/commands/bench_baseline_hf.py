"""`kvserve bench baseline-hf`: Hugging Face `generate` with static batching, alone."""

from __future__ import annotations

import argparse

from kvserve.config import defaults


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.cli import HelpFormatter

    parser = subparsers.add_parser(
        "baseline-hf",
        help="Hugging Face generate (static batching) on a bench workload",
        description="Run the requests `bench serve` would send through transformers' generate: batches "
        "of a fixed size, left-padded, greedy, min_new_tokens = max_new_tokens. Reports output "
        "tokens/s (only each request's own max_tokens count).",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--workload", choices=("mixed", "shared-prefix"), default="mixed", help="requests to run")
    parser.add_argument("--num-requests", type=int, default=32, help="requests in the workload")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (same requests as bench serve)")
    parser.add_argument("--max-tokens-cap", type=int, default=0, help="cap every request's max_tokens (0: no cap)")
    parser.add_argument("--batch-size", type=int, default=8, help="static batch size")
    parser.add_argument("--model", default=defaults.DEFAULT_MODEL, help="model name, HF directory or .gguf")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="write the JSON report to PATH (no PATH or '-': stdout)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import datetime as dt
    import sys

    from kvserve.bench import workloads
    from kvserve.bench.hf_baseline import load_model, requests_from_workload, run_hf_baseline
    from kvserve.bench.report import BenchReport, summarize_run
    from kvserve.commands.bench_serve import write_outputs
    from kvserve.executor.weights.model_store import ensure_model_dir
    from kvserve.log_config import configure_logging

    configure_logging()
    model_dir = ensure_model_dir(args.model)
    model = load_model(model_dir, num_threads=args.threads or None)
    [workload] = workloads.build(
        args.workload, args.num_requests, model.config.vocab_size, args.seed, args.max_tokens_cap or None
    )
    run_result, generated = run_hf_baseline(
        model,
        requests_from_workload(workload),
        batch_size=args.batch_size,
        workload_name=workload.name,
        progress=not args.no_progress,
    )
    report = BenchReport(
        meta={
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "model_dir": str(model_dir),
            "batch_size": args.batch_size,
            "hf_generated_tokens": generated,
            "seed": args.seed,
        }
    )
    report.results = [summarize_run(run_result)]
    return write_outputs(report, json_path=args.json, plot_path=None, stream=sys.stdout)
