"""Recording the logits of every sampled row a runner computes, for the LoRA batch-invariance tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.executor.lora.step_deltas import LoraStep
from kvserve.executor.model.input_batch import InputBatch
from kvserve.executor.model_runner import ModelRunner
from kvserve.testing.plan_driver import PlanDriver

Job = tuple[int, list[int], str]
"""(sequence id, prompt, LoRA adapter name or "")."""


class LogitLog:
    """Wraps `runner._forward`: each sampled row's logits by (sequence id, tokens known then)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.rows: dict[tuple[int, int], torch.Tensor] = {}
        self.mixed_steps = 0
        """Steps whose rows ran under the base model and at least two adapters."""
        self._forward = runner._forward

        def record(batch: InputBatch, lora: LoraStep | None = None) -> torch.Tensor | None:
            logits = self._forward(batch, lora)
            assert logits is not None and batch.sample_counts is None
            for seq, row in zip(batch.sampling_seqs, logits, strict=True):
                key = (seq.seq_id, len(seq.token_ids))
                assert key not in self.rows
                self.rows[key] = row.clone()
            adapters = set(batch.lora_indices or [])
            self.mixed_steps += -1 in adapters and len(adapters) >= 3
            return logits

        runner._forward = record  # type: ignore[method-assign]

    def detach(self) -> None:
        self.runner._forward = self._forward  # type: ignore[method-assign]


def run_alone(runner: ModelRunner, jobs: Sequence[Job], new_tokens: int) -> dict[tuple[int, int], torch.Tensor]:
    """Each job in steps of its own, to `new_tokens` greedy tokens: its logits per (sequence, tokens known)."""
    log = LogitLog(runner)
    for seq_id, prompt, adapter in jobs:
        driver = PlanDriver(runner)
        driver.add(seq_id, prompt, new_tokens, lora_name=adapter)
        driver.run()
    log.detach()
    return log.rows


def run_mixed(runner: ModelRunner, jobs: Sequence[Job], new_tokens: int, chunk: int | None = None) -> LogitLog:
    """Every job in the same steps (prompts in chunks of `chunk` tokens, or whole), detached once done."""
    log = LogitLog(runner)
    driver = PlanDriver(runner)
    for seq_id, prompt, adapter in jobs:
        driver.add(seq_id, prompt, new_tokens, lora_name=adapter, chunk_size=chunk)
    driver.run()
    log.detach()
    return log
