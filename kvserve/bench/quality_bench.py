"""`kvserve bench quality`: what a faster configuration costs in quality, against the fp32 path.

Two measures, both through the runner's own forward pass (`kvserve.executor.token_scoring`):

- **Perplexity** on a fixed public-domain text the package ships (`data/quality_text.txt`),
  cut into non-overlapping windows that are each scored from a fresh context.
- **Greedy agreement** on a fixed set of chat prompts. The fp32 reference decodes each
  prompt greedily; every other configuration is then fed the reference's text and its
  argmax compared at each position (top-1 agreement, teacher-forced, so one early
  difference does not count as many). Free-running greedy continuations that come out
  identical to the reference's are counted too.

Native Q4_1 and the dequantized fp32 weights hold the same quantized values, so only kernel
arithmetic (bfloat16 activations, bfloat16 scales) separates them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources

from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.token_scoring import score_tokens
from kvserve.protos.sampling import SamplingParams
from kvserve.testing.plan_driver import PlanDriver

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

    @property
    def name(self) -> str:
        return f"{self.dtype}/{self.weights}"


REFERENCE = QualityConfig("float32", "dequantized")
CANDIDATES = (
    QualityConfig("float32", "native", max_ppl_increase=0.02),
    QualityConfig("bfloat16", "dequantized", max_ppl_increase=0.01),
)
"""The project's quality bar: native Q4_1 within 2% of the fp32 perplexity, bfloat16 within 1%."""


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
