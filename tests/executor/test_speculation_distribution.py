"""Speculative decoding keeps the sampling distribution: a chi-square test on a tiny model.

A random 16-token Llama whose head is scaled up (so its next-token distributions are far from
uniform) samples with temperature 0.8 and top-p 0.9. After the first token, one draft is
proposed: the model's own most likely next token (computed with transformers), which the
sampled token matches about as often as that token's probability, so drafts are accepted and
rejected alike. `TRIALS` requests per arm, each with its own seed (the arms' seeds are
disjoint, so they are independent samples, not the same draws twice), give `OUTPUT_TOKENS`
tokens. The arms' empirical distributions of (token 0, token 1) and of (token 1, token 2),
the positions the draft and the bonus token land on, must pass a chi-square test of
homogeneity at significance `ALPHA`: speculation on is not told apart from off. A verifier
that accepts every draft, run the same way, must be.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.runner_config import RunnerConfig
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import SampledToken, StepPlan, StepResult
from kvserve.scheduler.core.request import Sequence
from kvserve.testing.in_process_serving import serve_in_process
from kvserve.testing.tiny_checkpoints import TINY, build_tiny_model

pytestmark = pytest.mark.timeout(900)

VOCAB = 16
TRIALS = 3000
"""Requests per arm: about 12 expected per cell of the 256 (token, token) pairs, ~190 per row."""
OUTPUT_TOKENS = 3
ALPHA = 0.001
PROMPT = [3, 0, 7, 12, 1, 9, 4, 15, 2, 11, 6]
HEAD_SCALE = 12.0
"""Random init gives near-uniform logits; scaled, the head gives peaked, row-dependent ones."""


@pytest.fixture(scope="module")
def model() -> Any:
    model = build_tiny_model("llama", seed=5, **(TINY | {"vocab_size": VOCAB, "tie_word_embeddings": False}))
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    return model


@pytest.fixture(scope="module")
def runner(model: Any, tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    path: Path = tmp_path_factory.mktemp("tiny-16")
    model.save_pretrained(path)
    return ModelRunner(RunnerConfig(model=str(path), dtype="float32", kv_cache_gb=0.05))


class GreedyProposer:
    """One draft: the model's most likely next token (memoized by context)."""

    from_executor = False

    def __init__(self, model: Any) -> None:
        self.model = model
        self.memo: dict[tuple[int, ...], int] = {}

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        context = tuple(seq.token_ids)
        if context not in self.memo:
            with torch.no_grad():
                self.memo[context] = int(self.model(torch.tensor([context])).logits[0, -1].argmax())
        return [self.memo[context]]

    def finished(self, seq: Sequence) -> None:
        pass


class AcceptEveryDraft:
    """A wrong verifier: every draft accepted, then the model's last draw as the bonus token."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.info = runner.info

    def execute(self, plan: StepPlan) -> StepResult:
        drafts = {known.seq_id: known.draft_token_ids for known in plan.known_seqs}
        result = self.runner.execute(plan)
        draws: dict[int, list[SampledToken]] = {}
        for out in result.outputs:
            draws.setdefault(out.seq_id, []).append(out)
        result.outputs = [
            token
            for seq_id, seq_draws in draws.items()
            for token in [SampledToken(seq_id=seq_id, token_id=t) for t in drafts.get(seq_id, [])] + seq_draws[-1:]
        ]
        return result


def _pairs(runner, seeds: range, proposer: GreedyProposer | None = None) -> tuple[Counter, Counter, int]:
    """Counts of (token 0, token 1) and (token 1, token 2) over one request per seed; and drafts accepted."""
    requests = {
        f"s{seed}": (
            PROMPT,
            SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=OUTPUT_TOKENS, ignore_eos=True),
        )
        for seed in seeds
    }
    served = serve_in_process(runner, requests, max_num_seqs=256, speculative_max_batch=256, proposer=proposer)
    first, second = Counter(), Counter()
    for tokens in served.tokens.values():
        assert len(tokens) == OUTPUT_TOKENS
        first[tokens[0], tokens[1]] += 1
        second[tokens[1], tokens[2]] += 1
    assert served.scheduler is not None
    return first, second, served.scheduler.stats().draft_tokens_accepted


def _p_value(a: Counter, b: Counter) -> float:
    """Pearson's chi-square test of homogeneity of two samples' counts over the same cells."""
    cells = sorted(set(a) | set(b))
    table = torch.tensor([[a[c] for c in cells], [b[c] for c in cells]], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    dof = len(cells) - 1
    # P(chi-square with `dof` degrees of freedom > statistic): the regularized upper incomplete gamma.
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def test_speculation_on_draws_from_the_distribution_of_off(runner: ModelRunner, model: Any) -> None:
    off_first, off_second, _ = _pairs(runner, range(TRIALS))
    on_first, on_second, accepted = _pairs(runner, range(TRIALS, 2 * TRIALS), GreedyProposer(model))
    assert TRIALS // 10 < accepted < TRIALS - TRIALS // 10  # one draft a request: often accepted, often not
    assert len(off_first) >= 10 and max(off_first.values()) < TRIALS // 2  # far from a point mass
    assert _p_value(on_first, off_first) > ALPHA
    assert _p_value(on_second, off_second) > ALPHA


def test_the_chi_square_tells_a_verifier_that_accepts_every_draft(runner: ModelRunner, model: Any) -> None:
    off_first, off_second, _ = _pairs(runner, range(TRIALS))
    wrong = AcceptEveryDraft(runner)
    wrong_first, wrong_second, _ = _pairs(wrong, range(TRIALS, 2 * TRIALS), GreedyProposer(model))
    assert min(_p_value(wrong_first, off_first), _p_value(wrong_second, off_second)) < ALPHA
