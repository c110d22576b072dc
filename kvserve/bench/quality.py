"""`kvserve bench quality`: what a faster configuration costs in quality, against the fp32 path.

Two measures, both through the runner's own forward pass (`kvserve.executor.token_scoring`):

- **Perplexity** on a fixed public-domain text the package ships (`data/quality_text.txt`),
  cut into non-overlapping windows that are each scored from a fresh context.
- **Greedy agreement** on a fixed set of chat prompts. The fp32 reference decodes each
  prompt greedily; every other configuration is then fed the reference's text and its
  argmax compared at each position (top-1 agreement, teacher-forced, so one early
  difference does not count as many). Free-running greedy continuations that come out
  identical to the reference's are counted too.

Native Q4_1 and the dequantized fp32 weights hold the same quantized values, and kvserve's Q4_1
kernel decodes them to the same float32 weights, so the layers differ only in summation order; the
native lm_head's Q8_0 rounding of the tied embedding is what separates them.

`kvserve bench quality` (`register`, `run`) prints a table, or `--json`. The model loads
inside `run`, so registering the command keeps `kvserve --help` free of torch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any

from kvserve.config import defaults
from kvserve.config.flags import HelpFormatter, add_flags, config_from_args, flag
from kvserve.executor.runner_config import DTYPES, WEIGHTS
from kvserve.protos.sampling import SamplingParams
from kvserve.testing.plan_driver import PlanDriver

if TYPE_CHECKING:
    from kvserve.executor.model_runner import ModelRunner

PROMPTS = (
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What does a compiler do?",
    "Name the planets of the solar system.",
    "Translate 'good morning' into Spanish and French.",
    "How many legs does a spider have?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "What is 17 times 23?",
)
"""Fixed chat prompts for greedy agreement (user turns; the model's chat template wraps them)."""


@dataclass(frozen=True, slots=True)
class QualityConfig:
    """One runner configuration to measure; `max_ppl_increase` is its goal, None for the reference."""

    dtype: str
    weights: str
    max_ppl_increase: float | None = None
    kv_cache_dtype: str = "auto"

    @property
    def name(self) -> str:
        kv = "" if self.kv_cache_dtype == "auto" else f"/{self.kv_cache_dtype}"
        return f"{self.dtype}/{self.weights}{kv}"


REFERENCE = QualityConfig("float32", "dequantized")
CANDIDATES = (
    QualityConfig("float32", "native", max_ppl_increase=0.02),
    QualityConfig("bfloat16", "dequantized", max_ppl_increase=0.01),
)
"""The project's quality bar: native Q4_1 within 2% of the fp32 perplexity, bfloat16 within 1%."""


@dataclass(frozen=True, slots=True)
class QualityBenchConfig:
    """`kvserve bench quality`'s flags."""

    model: str = field(
        default=defaults.DEFAULT_MODEL, metadata=flag("the default model's name or a .gguf file (native needs one)")
    )
    window: int = field(default=512, metadata=flag("tokens per perplexity window"))
    max_text_tokens: int | None = field(default=None, metadata=flag("score only the text's first N tokens"))
    max_new_tokens: int = field(default=48, metadata=flag("greedy tokens per prompt"))
    prompts: int | None = field(default=None, metadata=flag("use only the first N fixed prompts"))
    configs: tuple[str, ...] = field(
        default=tuple(c.name for c in CANDIDATES),
        metadata=flag(
            "configurations after the reference; a third part sets --kv-cache-dtype (float32/native/float32)",
            nargs="+",
            metavar="DTYPE/WEIGHTS[/KV]",
        ),
    )
    num_threads: int | None = field(default=None, metadata=flag("torch CPU threads"))
    json: bool = field(default=False, metadata=flag("print the results as JSON"))


def parse_config(spec: str) -> QualityConfig:
    """A `--configs` entry (`DTYPE/WEIGHTS[/KV]`, weights dequantized and the KV cache's dtype `auto`
    when left off), with the goal of its `CANDIDATES` entry, whatever its KV cache's dtype."""
    dtype, _, rest = spec.partition("/")
    weights, _, kv_cache_dtype = rest.partition("/")
    weights, kv_cache_dtype = weights or "dequantized", kv_cache_dtype or "auto"
    if dtype not in DTYPES or weights not in WEIGHTS or kv_cache_dtype not in ("auto", *DTYPES):
        raise ValueError(
            f"--configs {spec!r}: expected DTYPE/WEIGHTS[/KV], DTYPE and KV one of {', '.join(DTYPES)}, "
            f"WEIGHTS one of {', '.join(WEIGHTS)}"
        )
    known = {c.name: c.max_ppl_increase for c in CANDIDATES}
    return QualityConfig(dtype, weights, known.get(f"{dtype}/{weights}"), kv_cache_dtype)


@dataclass(slots=True)
class QualityResult:
    config: QualityConfig
    perplexity: float
    scored_tokens: int
    top1_agreement: float
    """Fraction of the reference's greedy tokens this configuration's argmax reproduces."""
    identical_continuations: int
    prompts: int
    reference_perplexity: float

    @property
    def ppl_increase(self) -> float:
        return self.perplexity / self.reference_perplexity - 1.0

    @property
    def passes(self) -> bool | None:
        bound = self.config.max_ppl_increase
        return None if bound is None else self.ppl_increase <= bound


def quality_text() -> str:
    """The shipped text without its `#` header and passage titles."""
    raw = resources.files("kvserve.bench").joinpath("data/quality_text.txt").read_text(encoding="utf-8")
    return "\n".join(line for line in raw.splitlines() if not line.startswith("#")).strip()


def text_windows(token_ids: Sequence[int], window: int, max_tokens: int | None = None) -> list[list[int]]:
    """Non-overlapping windows of at most `window` tokens (the last may be shorter, not under 2)."""
    ids = list(token_ids[:max_tokens] if max_tokens else token_ids)
    windows = [ids[i : i + window] for i in range(0, len(ids), window)]
    return [w for w in windows if len(w) >= 2]


def perplexity(runner: ModelRunner, windows: list[list[int]]) -> tuple[float, int]:
    """exp(mean negative log-likelihood) over every predicted token of every window."""
    from kvserve.executor.token_scoring import score_tokens

    total, count = 0.0, 0
    for ids in windows:
        scores = score_tokens(runner, ids)
        total -= float(scores.logprobs.double().sum())
        count += len(ids) - 1
    return math.exp(total / count), count


def greedy_continuations(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Each prompt decoded greedily, all in one batch; stop tokens end a continuation early."""
    driver = PlanDriver(runner)
    for i, prompt in enumerate(prompts):
        driver.add(i, prompt, max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature=0.0), seed=i)
    driver.run()
    return [driver.finished[i].outputs for i in range(len(prompts))]


def top1_agreement(runner: ModelRunner, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """Teacher-forced: the fraction of continuation tokens that are this runner's argmax."""
    from kvserve.executor.token_scoring import score_tokens

    hits = total = 0
    for prompt, continuation in zip(prompts, continuations):
        if not continuation:
            continue
        scores = score_tokens(runner, prompt + continuation)
        predicted = scores.argmax[len(prompt) - 1 :].tolist()
        hits += sum(p == t for p, t in zip(predicted, continuation))
        total += len(continuation)
    return hits / total if total else 1.0


def run_quality_bench(
    make_runner: Callable[[QualityConfig], ModelRunner],
    windows: list[list[int]],
    prompts: list[list[int]],
    max_new_tokens: int,
    configs: Sequence[QualityConfig] = CANDIDATES,
    progress: Callable[[str], None] = print,
) -> list[QualityResult]:
    """The reference first, then each of `configs`, one runner alive at a time."""
    results: list[QualityResult] = []
    reference_continuations: list[list[int]] = []
    for config in (REFERENCE, *configs):
        progress(f"loading {config.name}")
        runner = make_runner(config)
        try:
            progress(f"{config.name}: perplexity over {sum(len(w) for w in windows)} tokens")
            ppl, count = perplexity(runner, windows)
            progress(f"{config.name}: greedy decoding of {len(prompts)} prompts")
            continuations = greedy_continuations(runner, prompts, max_new_tokens)
            if config == REFERENCE:
                reference_continuations = continuations
            agreement = top1_agreement(runner, prompts, reference_continuations)
        finally:
            runner.close()
        identical = sum(a == b for a, b in zip(continuations, reference_continuations))
        reference_ppl = results[0].perplexity if results else ppl
        results.append(QualityResult(config, ppl, count, agreement, identical, len(prompts), reference_ppl))
        progress(f"{config.name}: perplexity {ppl:.4f}, top-1 agreement {100 * agreement:.2f}%")
    return results


def register(subparsers: argparse._SubParsersAction) -> None:
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
    add_flags(parser, QualityBenchConfig)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.runner_config import RunnerConfig
    from kvserve.executor.weights.model_store import ensure_model_dir
    from kvserve.log_config import configure_logging
    from kvserve.scheduler.server.intake.tokenizer import ChatMessage, Tokenizer

    config = config_from_args(QualityBenchConfig, args)
    try:  # refused now, not after the reference's minutes
        configs = [parse_config(spec) for spec in config.configs]
    except ValueError as exc:
        print(f"kvserve bench quality: {exc}", file=sys.stderr)
        return 2
    configure_logging(level="WARNING" if config.json else None)
    tokenizer = Tokenizer.from_dir(ensure_model_dir(config.model))
    windows = text_windows(tokenizer.encode(quality_text()), config.window, config.max_text_tokens)
    prompts = [tokenizer.encode_chat([ChatMessage(role="user", content=text)]) for text in PROMPTS[: config.prompts]]

    def make_runner(quality: QualityConfig) -> ModelRunner:
        return ModelRunner(
            RunnerConfig(
                model=config.model,
                device="cpu",
                dtype=quality.dtype,
                weights=quality.weights,
                kv_cache_dtype=quality.kv_cache_dtype,
                kv_cache_gb=0.25,
                num_threads=config.num_threads,
            )
        )

    progress = (lambda _m: None) if config.json else print
    results = run_quality_bench(make_runner, windows, prompts, config.max_new_tokens, configs, progress=progress)
    if config.json:
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
    print(f"scored {results[0].scored_tokens} tokens in windows of {config.window}")
    return 0


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
