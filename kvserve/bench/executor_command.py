"""`kvserve bench executor` (`register`, `run`): its flags, the runner or group it measures, its KV budget.

It takes the runner's own flags (those of `kvserve executor`: RunnerConfig and
TensorParallelConfig) and the bench's (`ExecutorBenchConfig`), measures with `executor.py` and
prints with `executor_report.py`. torch loads inside the functions that use it, so registering the
command keeps `kvserve --help` free of it.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from kvserve.bench.executor import run_executor_bench
from kvserve.bench.executor_report import json_report, text_report
from kvserve.config import defaults
from kvserve.config.flags import HelpFormatter, add_flags, config_from_args, flag
from kvserve.executor.runner_config import RunnerConfig
from kvserve.executor.tensor_parallel.config import TensorParallelConfig

if TYPE_CHECKING:
    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.protocol import Executor

PROG = "kvserve bench executor"
_RUNNER = "model runner (as kvserve executor)"
_KV_HELP = "KV budget (default: just enough for the largest configuration)"


@dataclass(frozen=True, slots=True)
class ExecutorBenchConfig:
    """`kvserve bench executor`'s own flags, beside the runner's."""

    batches: tuple[int, ...] = field(default=(1, 8, 32, 64), metadata=flag("decode batch sizes", nargs="+"))
    prompt_len: int = field(default=128, metadata=flag("context of each decoding sequence"))
    steps: int = field(default=8, metadata=flag("timed decode steps per batch size (the median counts)"))
    prefill_len: int = field(default=512, metadata=flag("tokens per prefill prompt"))
    prefill_batches: tuple[int, ...] = field(default=(1, 4), metadata=flag("prompts per prefill step", nargs="*"))
    sample: bool = field(default=False, metadata=flag("sample with temperature 0.8, top-p 0.95 instead of greedy"))
    json: bool = field(
        default=False,
        metadata=flag(
            "print one JSON object: dtype, weights, tensor_parallel_size, gemm_flops, copy_bandwidth, "
            "weight_bytes, kv_bytes_per_seq, rss_mib and results [{phase, batch, tokens_per_s, roofline_fraction, "
            "step_s, broadcast_s, decode_plan_s, plan_bytes, limit_fraction}] (broadcast_s, decode_plan_s and "
            "plan_bytes null on one rank, limit_fraction on prefill)"
        ),
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "executor",
        help="model runner tokens/s for decode and prefill, against the GEMM roofline",
        description="Runs the model runner in-process with synthetic plans. The roofline is a large\n"
        "matmul's FLOP/s measured in the same run; each figure's fraction is\n"
        "tokens/s x FLOPs per token / roofline (2 x parameters for decode; prefill\n"
        "tokens skip the lm_head). --no-batch-invariant measures what batch invariance costs;\n"
        "-tp N shards the model over N ranks, and each decode batch then also reports its\n"
        "plan's size, rank 0's broadcast and the other ranks' decode of it.",
        formatter_class=HelpFormatter,
    )
    add_flags(parser, ExecutorBenchConfig)
    add_flags(
        parser,
        RunnerConfig,
        group=_RUNNER,
        overrides={"model": {"default": defaults.DEFAULT_MODEL}, "kv_cache_gb": {"help": _KV_HELP}},
    )
    add_flags(parser, TensorParallelConfig, group=_RUNNER)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.executor.tensor_parallel.layout import TensorParallelFitError
    from kvserve.log_config import configure_logging

    bench = config_from_args(ExecutorBenchConfig, args)
    configure_logging(level="WARNING" if bench.json else None)
    try:
        parallel = config_from_args(TensorParallelConfig, args)
        config = config_from_args(RunnerConfig, args)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if config.kv_cache_gb is None and not config.device.startswith("cuda"):
        # Each decoding sequence holds whole blocks: its context rounded up to the block size.
        per_sequence = -(-(bench.prompt_len + bench.steps + 4) // config.block_size) * config.block_size
        tokens = max(max(bench.batches) * per_sequence, max(bench.prefill_batches or [1]) * bench.prefill_len)
        config.kv_cache_gb = _gib_for_tokens(config, tokens + 64 * config.block_size, parallel.tensor_parallel_size)
    if bench.json:  # the other ranks log as quietly as this one
        os.environ.setdefault("KVSERVE_LOG_LEVEL", "WARNING")
    try:
        executor, runner = _start(config, parallel)
    except TensorParallelFitError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2

    def show(measured: tuple[str, int, float]) -> None:
        if not bench.json:
            print(f"measured {measured[0]} batch {measured[1]}: {measured[2]:.1f} tokens/s", flush=True)

    try:
        gemm, limit, results = run_executor_bench(
            executor,
            bench.batches,
            bench.prefill_batches,
            bench.prompt_len,
            bench.prefill_len,
            bench.steps,
            greedy=not bench.sample,
            progress=show,
            runner=runner,
        )
        render = json_report if bench.json else text_report
        print(render(runner, parallel.tensor_parallel_size, gemm, limit, results))
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
