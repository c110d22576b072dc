"""`kvserve bench executor`: the model runner's tokens/s and its fraction of the GEMM roofline."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from protos import defaults

DEFAULT_DECODE_BATCHES = (1, 8, 32, 64)
GOAL_DECODE64_ROOFLINE = 0.5
"""The project's CPU goal: decode at batch 64 reaches at least half the fp32 GEMM roofline."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from executor_svc.runner_config import ATTENTION_BACKENDS, DTYPES, WEIGHTS
    from kvserve.cli import HelpFormatter

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
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: dtype, weights, gemm_flops, rss_mib and results "
        "[{phase, batch, tokens_per_s, roofline_fraction}]",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from executor_svc.model_runner import ModelRunner
    from executor_svc.process_memory import MIB, resident_bytes
    from executor_svc.runner_config import RunnerConfig
    from kvserve.bench.executor_bench import run_executor_bench
    from protos.log_config import configure_logging

    configure_logging(level="WARNING" if args.json else None)
    config = RunnerConfig(
        model=args.model,
        device=args.device,
        attention_backend=args.attention_backend,
        dtype=args.dtype,
        weights=args.weights,
        kv_cache_gb=args.kv_cache_gb,
        num_threads=args.num_threads,
    )
    if config.kv_cache_gb is None and not args.device.startswith("cuda"):
        tokens = max(
            max(args.batches) * (args.prompt_len + args.steps + 4), max(args.prefill_batches or [1]) * args.prefill_len
        )
        config.kv_cache_gb = _gib_for_tokens(config, tokens + 64 * defaults.BLOCK_SIZE)
    runner = ModelRunner(config)

    def show(measured: tuple[str, int, float]) -> None:
        if not args.json:
            print(f"measured {measured[0]} batch {measured[1]}: {measured[2]:.1f} tokens/s", flush=True)

    gemm, results = run_executor_bench(
        runner,
        args.batches,
        args.prefill_batches,
        args.prompt_len,
        args.prefill_len,
        args.steps,
        greedy=not args.sample,
        progress=show,
    )
    if args.json:
        report = {
            "dtype": runner.dtype_name,
            "weights": runner.weights_mode,
            "device": runner.device,
            "gemm_flops": gemm,
            "rss_mib": resident_bytes() / MIB,
            "results": [asdict(r) for r in results],
        }
        print(json.dumps(report))
    else:
        for r in results:
            print(
                f"{r.phase:7s} batch {r.batch:3d}  {r.tokens_per_s:9.1f} tokens/s  "
                f"{100 * r.roofline_fraction:5.1f}% of GEMM roofline"
            )
        print(
            f"GEMM roofline: {gemm / 1e9:.1f} GFLOP/s ({runner.dtype_name}, {runner.device}); "
            f"model {runner.model_config.num_params / 1e6:.1f} M params; "
            f"goal: decode batch 64 >= {100 * GOAL_DECODE64_ROOFLINE:.0f}% of the roofline"
        )
        print(f"executor resident memory after the run: {resident_bytes() / MIB:.0f} MiB")
    runner.close()
    return 0


def _gib_for_tokens(config, tokens: int) -> float:
    """KV GiB for `tokens` cached tokens of the configured model, in float32."""
    from executor_svc.model_config import load_model_config
    from executor_svc.model_store import ensure_model_dir

    cfg = load_model_config(ensure_model_dir(config.model))
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    return tokens * per_token / 1024**3
