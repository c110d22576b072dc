"""`kvserve serve`: the scheduler plus a supervised executor child, one command.

The executor runs as `python -m kvserve executor ...` in its own process; if it dies,
it is restarted and the scheduler re-syncs it, so in-flight requests complete.
"""

from __future__ import annotations

import argparse
import shlex

from protos import defaults


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.cli import HelpFormatter
    from kvserve.commands.scheduler import add_server_options

    parser = subparsers.add_parser(
        "serve", help="serve a model: scheduler + supervised executor (gRPC on 127.0.0.1:50051)",
        description="Start the executor as a supervised child process and the scheduler with its gRPC API. "
                    "Prints where it listens once healthy. Stop with Ctrl-C or SIGTERM (drains first).",
        formatter_class=HelpFormatter,
    )
    ex = parser.add_argument_group("executor")
    ex.add_argument("--executor", choices=("torch", "fake"), default="torch",
                    help="torch: the real model (triton attention on CUDA); fake: no model, for tests")
    ex.add_argument("--model", default=defaults.DEFAULT_MODEL,
                    help="the default model's name, an HF model directory, or a .gguf file")
    ex.add_argument("--kv-cache-gb", type=float, default=None,
                    help=f"KV cache budget in GiB; None: {defaults.KV_CACHE_GB_CPU} on CPU, sized from free "
                         "memory on CUDA")
    ex.add_argument("--num-blocks", type=int, default=None, help="KV blocks of the fake executor; None: its own default")
    ex.add_argument("--step-latency-ms", type=float, default=None, help="per-step latency of the fake executor; None: its own default")
    ex.add_argument("--executor-args", default="", help="extra `kvserve executor` options, shell-quoted")
    ex.add_argument("--link", default="", help="ZeroMQ endpoint for the executor link; empty: an ipc socket in a private runtime dir")
    ex.add_argument("--no-executor-restart", dest="executor_restart", action="store_false",
                    help="do not restart the executor when it dies; requests then fail after the restart timeout "
                         "(the default shown is whether restarts are on)")
    add_server_options(parser)
    parser.set_defaults(func=run)


def executor_args(args: argparse.Namespace, endpoint: str) -> list[str]:
    """`kvserve executor` options for the supervised child."""
    argv = ["--executor", args.executor, "--link", endpoint, "--model", args.model,
            # the executor sizes its buffers for the same budgets the scheduler will plan with
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs)]
    if args.max_model_len is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.kv_cache_gb is not None:
        argv += ["--kv-cache-gb", str(args.kv_cache_gb)]
    if args.num_blocks is not None:
        argv += ["--num-blocks", str(args.num_blocks)]
    if args.step_latency_ms is not None:
        argv += ["--step-latency-ms", str(args.step_latency_ms)]
    return argv + shlex.split(args.executor_args)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from protos.log_config import configure_logging
    from kvserve.commands.scheduler import server_config_from_args
    from scheduler_svc.server.executor_supervisor import ExecutorSupervisor, executor_command
    from scheduler_svc.server.service import resolve_link_endpoint, run_service

    configure_logging(process="scheduler")
    config = server_config_from_args(args, link=args.link)
    endpoint = resolve_link_endpoint(config)
    supervisor = ExecutorSupervisor(executor_command(executor_args(args, endpoint)), restart=args.executor_restart)
    return asyncio.run(run_service(config, endpoint=endpoint, supervisor=supervisor))
