"""`kvserve bench quality`: perplexity and greedy agreement of each dtype/--weights against fp32."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from kvserve.config import defaults

if TYPE_CHECKING:
    from kvserve.bench.quality_bench import QualityConfig, QualityResult


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.cli import HelpFormatter

    parser = subparsers.add_parser(
        "quality",
        help="perplexity and greedy agreement of native Q4_1 and bfloat16 against the fp32 path",
        description="Loads the model once per configuration (fp32 dequantized first, the reference),\n"
        "scores the shipped public-domain text (perplexity over non-overlapping windows),\n"
        "and compares greedy decoding of fixed chat prompts with the reference's: top-1\n"
        "agreement teacher-forced on the reference's tokens, and identical continuations.\n"
        "Goals: native Q4_1 perplexity within 2% of fp32, bfloat16 within 1%.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--model", default=defaults.DEFAULT_MODEL, help="the default model's name or a .gguf file (native needs one)"
    )
    parser.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    parser.add_argument("--max-text-tokens", type=int, default=None, help="score only the text's first N tokens")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="greedy tokens per prompt")
    parser.add_argument("--prompts", type=int, default=None, help="use only the first N fixed prompts")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=None,
        type=_config,
        metavar="DTYPE/WEIGHTS",
        help="configurations after the reference (default: float32/native bfloat16/dequantized)",
    )
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.bench import quality_bench as qb
    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.runner_config import RunnerConfig
    from kvserve.executor.weights.model_store import ensure_model_dir
    from kvserve.log_config import configure_logging
    from kvserve.scheduler.server.tokenizer import ChatMessage, Tokenizer

    configure_logging(level="WARNING" if args.json else None)
    configs = qb.CANDIDATES if args.configs is None else args.configs
    tokenizer = Tokenizer.from_dir(ensure_model_dir(args.model))
    windows = qb.text_windows(tokenizer.encode(qb.quality_text()), args.window, args.max_text_tokens)
    prompts = [tokenizer.encode_chat([ChatMessage(role="user", content=text)]) for text in qb.PROMPTS[: args.prompts]]

    def make_runner(config: qb.QualityConfig) -> ModelRunner:
        return ModelRunner(
            RunnerConfig(
                model=args.model,
                device="cpu",
                dtype=config.dtype,
                weights=config.weights,
                kv_cache_gb=0.25,
                num_threads=args.num_threads,
            )
        )

    results = qb.run_quality_bench(
        make_runner, windows, prompts, args.max_new_tokens, configs, progress=(lambda _m: None) if args.json else print
    )
    if args.json:
        print(json.dumps([_row(r) for r in results]))
        return 0
    print(f"{'configuration':24s} {'perplexity':>10s} {'vs fp32':>8s} {'top-1 agree':>11s} {'identical':>9s}  goal")
    for r in results:
        bound = r.config.max_ppl_increase  # None exactly when r.passes is None: the reference
        goal = "reference" if bound is None else f"<= +{100 * bound:.0f}%: " + ("met" if r.passes else "MISSED")
        print(
            f"{r.config.name:24s} {r.perplexity:10.4f} {100 * r.ppl_increase:+7.2f}% "
            f"{100 * r.top1_agreement:10.2f}% {r.identical_continuations:4d}/{r.prompts:<4d}  {goal}"
        )
    print(f"scored {results[0].scored_tokens} tokens in windows of {args.window}")
    return 0


def _config(spec: str) -> QualityConfig:
    """A --configs entry, refused at parse time (not after the reference's minutes) when unknown."""
    from kvserve.bench.quality_bench import CANDIDATES, QualityConfig
    from kvserve.executor.runner_config import DTYPES, WEIGHTS

    dtype, _, weights = spec.partition("/")
    weights = weights or "dequantized"
    if dtype not in DTYPES or weights not in WEIGHTS:
        raise argparse.ArgumentTypeError(
            f"{spec!r}: expected DTYPE/WEIGHTS, DTYPE one of {', '.join(DTYPES)}, WEIGHTS one of {', '.join(WEIGHTS)}"
        )
    known = {c.name: c for c in CANDIDATES}
    return known.get(f"{dtype}/{weights}", QualityConfig(dtype, weights))


def _row(result: QualityResult) -> dict[str, Any]:
    return {
        "config": result.config.name,
        "perplexity": result.perplexity,
        "ppl_increase": result.ppl_increase,
        "max_ppl_increase": result.config.max_ppl_increase,
        "passes": result.passes,
        "top1_agreement": result.top1_agreement,
        "identical_continuations": result.identical_continuations,
        "prompts": result.prompts,
        "scored_tokens": result.scored_tokens,
    }
