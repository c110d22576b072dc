"""`--speculative draft` on the real runner: a draft model's proposals, verified, give the tokens of off.

No smaller model with SmolLM2's tokenizer ships, so two draft models stand in:

- **SmolLM2 itself.** Drafting for itself it proposes exactly what the served model then draws
  greedily, so nearly every draft must be accepted. That holds only if its KV cache, which
  shares the served model's block ids, is right after prefix sharing, copy-on-write, swaps and
  recomputes: a broken catch-up, block op or scratch block shows up as rejected drafts.
- **A tiny random Llama with the same 49,152-token vocabulary**, as a real deployment's draft
  would be (smaller, same tokenizer): its drafts are mostly wrong, and the tokens must still be
  those of speculation off.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.bench.copy_workload import ModelTextEncoder, copy_workload
from kvserve.config import defaults
from kvserve.executor.config_error import ExecutorConfigError
from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.runner_config import RunnerConfig
from kvserve.protos.sampling import SamplingParams
from kvserve.testing.in_process_serving import Served, serve_in_process
from kvserve.testing.tiny_checkpoints import TINY, write_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

KV_GB = 0.1
VOCAB = 49152


@pytest.fixture(scope="module")
def requests(default_model_dir) -> dict[str, tuple[list[int], SamplingParams]]:
    encoder = ModelTextEncoder(lambda: default_model_dir)
    workload = copy_workload(3, seed=5, encoder=encoder, max_tokens_cap=40)
    chat = encoder.encode_chat("What is the capital of France?")
    out = {s.session_id: (s.turns[0].new_token_ids, _greedy(s.turns[0].max_tokens)) for s in workload.sessions}
    return out | {"chat": (chat, _greedy(24))}


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def self_drafting() -> ModelRunner:
    return ModelRunner(RunnerConfig(kv_cache_gb=KV_GB, swap_space_gb=0.05, draft_model=defaults.DEFAULT_MODEL))


@pytest.fixture(scope="module")
def reference(self_drafting: ModelRunner, requests) -> dict[tuple[str, int], list[int]]:
    served = serve_in_process(self_drafting, requests)
    assert served.scheduler is not None and served.scheduler.stats().draft_tokens_proposed == 0
    return served.tokens


def _acceptance(served: Served) -> float:
    assert served.scheduler is not None
    stats = served.scheduler.stats()
    assert stats.draft_tokens_proposed > 0
    return stats.draft_tokens_accepted / stats.draft_tokens_proposed


@pytest.mark.parametrize(
    "policy",
    [
        {},
        {"one_at_a_time": True},
        {"max_num_batched_tokens": 24},
        {"num_blocks": 14},
        {"num_blocks": 14, "preemption_mode": "swap"},
    ],
    ids=["batched", "one-at-a-time", "chunked", "preempted-recompute", "preempted-swap"],
)
def test_drafting_for_itself_accepts_nearly_everything_with_the_same_tokens(
    self_drafting: ModelRunner, requests, reference, policy: dict
) -> None:
    served = serve_in_process(self_drafting, requests, speculative="draft", **policy)
    assert served.tokens == reference
    assert _acceptance(served) >= 0.9
    assert served.steps < sum(len(t) for t in reference.values()) // 2
    if "num_blocks" in policy:
        assert served.scheduler is not None
        stats = served.scheduler.stats()
        assert stats.num_preemptions > 0 and (stats.num_swap_outs > 0) == ("preemption_mode" in policy)


def test_seeded_samples_are_those_of_speculation_off(self_drafting: ModelRunner, requests) -> None:
    sampled = {
        rid: (ids, SamplingParams(temperature=0.8, top_p=0.9, seed=9, n=2, max_tokens=24, ignore_eos=True))
        for rid, (ids, _) in list(requests.items())[:2]
    }
    off = serve_in_process(self_drafting, sampled)
    on = serve_in_process(self_drafting, sampled, speculative="draft")
    assert on.tokens == off.tokens and len(on.tokens) == 4
    assert _acceptance(on) > 0.3


def test_a_tiny_draft_with_the_same_vocabulary_shares_the_budget_and_keeps_the_tokens(
    tmp_path_factory: pytest.TempPathFactory, self_drafting: ModelRunner, requests, reference
) -> None:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-draft"), "llama", **(TINY | {"vocab_size": VOCAB}))
    runner = ModelRunner(RunnerConfig(kv_cache_gb=KV_GB, draft_model=str(path)))
    assert runner.draft is not None and runner.info().draft_model_id == path.name
    per_block = runner.geometry.bytes_per_block + runner.draft.geometry.bytes_per_block
    assert runner.info().num_blocks == int(KV_GB * 2**30 // per_block)  # one budget for both caches
    served = serve_in_process(runner, requests, speculative="draft")
    assert served.tokens == reference
    assert served.scheduler is not None and served.scheduler.stats().draft_tokens_proposed > 0


def test_a_draft_with_another_vocabulary_is_refused(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path / "other-vocab", "llama", **TINY)
    with pytest.raises(ExecutorConfigError, match=r"--draft-model .*256 tokens.*49152"):
        ModelRunner(RunnerConfig(kv_cache_gb=KV_GB, draft_model=str(path)))
