"""Teacher-forced scoring (`kvserve.executor.token_scoring`) on a tiny random Llama on the CPU.

Where the runner took the CPU kernels, the logprobs are the kernels' log_softmax (the same bits on
any x86 CPU), within float rounding of torch's."""

from __future__ import annotations

import pytest
import torch

from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.runner_config import RunnerConfig
from kvserve.executor.token_scoring import every_position_logits, score_tokens
from kvserve.kernels import cpu_ops
from kvserve.testing.tiny_checkpoints import tiny_checkpoint


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    _, path = tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")
    config = RunnerConfig(model=str(path), device="cpu", dtype="float32", kv_cache_gb=0.001, attention_backend="cpu")
    return ModelRunner(config)  # the CPU backend loads the kernels


def test_scores_are_the_kernels_log_softmax_of_every_positions_logits(runner: ModelRunner) -> None:
    assert cpu_ops.is_loaded()
    tokens = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    scores = score_tokens(runner, tokens)
    logits = every_position_logits(runner, tokens)[:-1]
    targets = torch.tensor(tokens[1:])[:, None]
    kernels = cpu_ops.log_softmax(logits).gather(1, targets)[:, 0]
    assert torch.equal(scores.logprobs.view(torch.int32), kernels.view(torch.int32))
    torch.testing.assert_close(scores.logprobs, logits.log_softmax(-1).gather(1, targets)[:, 0], rtol=1e-6, atol=2e-6)
    assert torch.equal(scores.argmax, logits.argmax(-1))
