"""LoRA on the native path (`--weights native`, the default model's Q4_1 layers): batch invariance kept.

A step with rows under adapters runs the fused C++ decoder layers (`NativeLayers.run`) too, each
layer adding the deltas in float32 to its Q4_1 products (`KernelLoraStep.layer_lora`). Every row
must get the logits it gets alone: the base model's rows and the adapters' rows, whatever shares
their step.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvserve.executor.model_config import load_model_config
from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.runner_config import RunnerConfig
from kvserve.scheduler.server.intake.tokenizer import Tokenizer
from kvserve.testing.lora_adapters import write_lora_adapter
from tests.executor.lora_logits import Job, run_alone, run_mixed

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
RANKS = {"alpha": 16, "beta": 8, "gamma": 16, "delta": 4}
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea and the wind:",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
]


@pytest.fixture(scope="module")
def runner(default_model_dir, tmp_path_factory) -> Iterator[ModelRunner]:
    config = load_model_config(default_model_dir)
    root = tmp_path_factory.mktemp("lora-native")
    lora = tuple(
        f"{name}={write_lora_adapter(root / name, config, rank=rank, seed=seed)}"
        for seed, (name, rank) in enumerate(RANKS.items())
    )
    runner = ModelRunner(RunnerConfig(weights="native", kv_cache_gb=0.25, lora=lora))
    assert runner.weights_mode == "native" and runner.model.native_layers is not None
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def jobs(default_model_dir) -> list[Job]:
    """The base model on two prompts, each adapter on one, and two adapters on the first prompt."""
    tokenizer = Tokenizer.from_dir(default_model_dir)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    names = list(RANKS)
    return [
        (0, ids[0], ""),
        (1, ids[1], ""),
        *[(2 + i, ids[i], name) for i, name in enumerate(names)],
        (6, ids[0], "gamma"),
        (7, ids[0], "delta"),
    ]


@pytest.fixture(scope="module")
def alone(runner, jobs) -> dict[tuple[int, int], torch.Tensor]:
    return run_alone(runner, jobs, NEW_TOKENS)


def test_adapters_change_their_rows_on_the_native_path(jobs, alone) -> None:
    first = [alone[(seq_id, len(prompt))] for seq_id, prompt, _ in jobs if seq_id in (0, 2, 6, 7)]
    for i, a in enumerate(first):
        for b in first[i + 1 :]:
            assert (a - b).abs().max() > 1e-2  # the same prompt: base, alpha, gamma, delta


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole-prompts", "chunks-of-5"])
def test_a_mixed_native_step_gives_every_row_its_logits_alone(runner, jobs, alone, chunk) -> None:
    log = run_mixed(runner, jobs, NEW_TOKENS, chunk)
    assert log.mixed_steps >= NEW_TOKENS - 1
    assert log.rows.keys() == alone.keys()
    for key, logits in log.rows.items():
        assert torch.equal(logits, alone[key]), f"row {key} differs batched"
