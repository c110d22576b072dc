"""`kvserve bench executor`: the model runner's tokens/s and its fraction of the GEMM roofline."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, cast

from kvserve.config import defaults

if TYPE_CHECKING:
    from kvserve.bench.executor_bench import BenchResult
    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.protocol import Executor
    from kvserve.executor.runner_config import RunnerConfig
    from kvserve.executor.tensor_parallel.config import TensorParallelConfig

PROG = "kvserve bench executor"

DEFAULT_DECODE_BATCHES = (1, 8, 32, 64)
GOAL_DECODE64_ROOFLINE = 0.5
"""The project's CPU goal: decode at batch 64 reaches at least half the fp32 GEMM roofline."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.cli import HelpFormatter
    from kvserve.executor.runner_config import ATTENTION_BACKENDS, DTYPES, WEIGHTS

    parser = subparsers.add_parser(
        "executor",
        help="model runner tokens/s for decode and prefill, against the GEMM roofline",
        description="Runs the model runner in-process with synthetic plans. The roofline is a large\n"
        "matmul's FLOP/s measured in the same run; each figure's fraction is\n"
        "tokens/s x FLOPs per token / roofline (2 x parameters for decode; prefill\n"
        "tokens skip the lm_head).",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--model",
        default=defaults.DEFAULT_MODEL,
        help="the default model's name, an HF model directory, or a .gguf file",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--attention-backend", default="auto", choices=("auto", *ATTENTION_BACKENDS))
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPES),
        help="activation and weight dtype",
    )
    parser.add_argument(
        "--weights",
        default="auto",
        choices=("auto", *WEIGHTS),
        help="native: a GGUF's Q4_1 layers run 4-bit (see `kvserve executor --help`)",
    )
    parser.add_argument(
        "--no-batch-invariant",
        dest="batch_invariant",
        action="store_false",
        help="torch's own CPU attention and unpadded GEMMs, as `kvserve executor --no-batch-invariant` "
        "(to measure what batch invariance costs)",
    )
    parser.add_argument(
        "--batches", type=int, nargs="+", default=list(DEFAULT_DECODE_BATCHES), help="decode batch sizes"
    )
    parser.add_argument("--prompt-len", type=int, default=128, help="context of each decoding sequence")
    parser.add_argument(
        "--steps",
        type=int,
        default=8,
        help="timed decode steps per batch size (the median counts)",
    )
    parser.add_argument("--prefill-len", type=int, default=512, help="tokens per prefill prompt")
    parser.add_argument("--prefill-batches", type=int, nargs="*", default=[1, 4], help="prompts per prefill step")
    parser.add_argument(
        "--sample", action="store_true", help="sample with temperature 0.8, top-p 0.95 instead of greedy"
    )
    parser.add_argument(
        "--kv-cache-gb", type=float, default=None, help="KV budget (default: just enough for the largest configuration)"
    )
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (per rank)")
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="ranks the model is sharded across, one process each (as `kvserve executor -tp N`); each decode "
        "batch also reports its plan's size, rank 0's broadcast and the other ranks' decode of it",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: dtype, weights, tensor_parallel_size, gemm_flops, rss_mib and results "
        "[{phase, batch, tokens_per_s, roofline_fraction, step_s, broadcast_s, decode_plan_s, plan_bytes}] "
        "(the last three null on one rank)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.executor_bench import run_executor_bench
    from kvserve.executor.process_memory import MIB, resident_bytes
    from kvserve.executor.runner_config import RunnerConfig
    from kvserve.executor.tensor_parallel.config import TensorParallelConfig
    from kvserve.executor.tensor_parallel.layout import TensorParallelFitError
    from kvserve.log_config import configure_logging

    configure_logging(level="WARNING" if args.json else None)
    try:
        parallel = TensorParallelConfig(tensor_parallel_size=args.tensor_parallel_size)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    config = RunnerConfig(
        model=args.model,
        device=args.device,
        attention_backend=args.attention_backend,
        dtype=args.dtype,
        weights=args.weights,
        kv_cache_gb=args.kv_cache_gb,
        num_threads=args.num_threads,
        batch_invariant=args.batch_invariant,
    )
    if config.kv_cache_gb is None and not args.device.startswith("cuda"):
        # Each decoding sequence holds whole blocks: its context rounded up to the block size.
        per_sequence = -(-(args.prompt_len + args.steps + 4) // defaults.BLOCK_SIZE) * defaults.BLOCK_SIZE
        tokens = max(max(args.batches) * per_sequence, max(args.prefill_batches or [1]) * args.prefill_len)
        config.kv_cache_gb = _gib_for_tokens(config, tokens + 64 * defaults.BLOCK_SIZE, args.tensor_parallel_size)
    if args.json:  # the other ranks log as quietly as this one
        os.environ.setdefault("KVSERVE_LOG_LEVEL", "WARNING")
    try:
        executor, runner = _start(config, parallel)
    except TensorParallelFitError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2

    def show(measured: tuple[str, int, float]) -> None:
        if not args.json:
            print(f"measured {measured[0]} batch {measured[1]}: {measured[2]:.1f} tokens/s", flush=True)

    try:
        gemm, results = run_executor_bench(
            executor,
            args.batches,
            args.prefill_batches,
            args.prompt_len,
            args.prefill_len,
            args.steps,
            greedy=not args.sample,
            progress=show,
            runner=runner,
        )
        if args.json:
            report = {
                "dtype": runner.dtype_name,
                "weights": runner.weights_mode,
                "device": runner.device,
                "attention_backend": runner.backend_name,
                "batch_invariant": runner.invariant,
                "tensor_parallel_size": parallel.tensor_parallel_size,
                "gemm_flops": gemm,
                "rss_mib": resident_bytes() / MIB,
                "results": [asdict(r) for r in results],
            }
            print(json.dumps(report))
        else:
            for r in results:
                print(_result_line(r))
            ranks = parallel.tensor_parallel_size
            print(
                f"GEMM roofline: {gemm / 1e9:.1f} GFLOP/s ({f'{ranks} ranks, ' if ranks > 1 else ''}"
                f"{runner.dtype_name}, {runner.device}, attention {runner.backend_name}, "
                f"batch-invariant {'on' if runner.invariant else 'off'}); "
                f"model {runner.model_config.num_params / 1e6:.1f} M params; "
                f"goal: decode batch 64 >= {100 * GOAL_DECODE64_ROOFLINE:.0f}% of the roofline"
            )
            rank0 = " (rank 0)" if ranks > 1 else ""
            print(f"executor resident memory after the run{rank0}: {resident_bytes() / MIB:.0f} MiB")
    finally:
        executor.close()  # a group's other ranks leave with it
    return 0


def _start(config: RunnerConfig, parallel: TensorParallelConfig) -> tuple[Executor, ModelRunner]:
    """(the executor to drive, rank 0's runner): one runner here, or rank 0 of a group whose other
    ranks are this process's children."""
    if parallel.tensor_parallel_size == 1:
        from kvserve.executor.model_runner import ModelRunner

        runner = ModelRunner(config)
        return runner, runner
    from kvserve.executor.process import start_local_group

    group = start_local_group(config, parallel)
    return group, cast("ModelRunner", group.runner)


def _result_line(r: BenchResult) -> str:
    line = (
        f"{r.phase:7s} batch {r.batch:3d}  {r.tokens_per_s:9.1f} tokens/s  {1e3 * r.step_s:8.2f} ms/step  "
        f"{100 * r.roofline_fraction:5.1f}% of GEMM roofline"
    )
    if r.plan_bytes is None or r.broadcast_s is None or r.decode_plan_s is None:
        return line
    return (
        f"{line} | plan {_size(r.plan_bytes)}: broadcast {1e3 * r.broadcast_s:.2f} ms, "
        f"decode {1e3 * r.decode_plan_s:.2f} ms"
    )


def _size(num_bytes: int) -> str:
    return f"{num_bytes} B" if num_bytes < 1000 else f"{num_bytes / 1e3:.1f} kB"


def _gib_for_tokens(config: RunnerConfig, tokens: int, ranks: int = 1) -> float:
    """KV GiB for `tokens` cached tokens of the configured model, in float32, on each of `ranks`
    tensor-parallel ranks (each holds its share of the KV heads). A size the model does not fit
    gets the whole model's figure here; starting the group then refuses it."""
    from kvserve.executor.model_config import load_model_config
    from kvserve.executor.tensor_parallel.layout import TensorParallelFitError, plan_layout
    from kvserve.executor.weights.model_store import ensure_model_dir
    from kvserve.protos.kv_geometry import GIB, KvGeometry, bytes_per_token

    cfg = load_model_config(ensure_model_dir(config.model))
    try:
        kv_heads = plan_layout(cfg, 0, ranks).num_kv_heads
    except TensorParallelFitError:
        kv_heads = cfg.num_kv_heads
    return tokens * bytes_per_token(KvGeometry(cfg.num_layers, kv_heads, cfg.head_dim), "float32") / GIB
