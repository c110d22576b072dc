"""What the runner holds of LoRA: the adapters by name, their slots, and each step's deltas.

Loaded once at start-up from `--lora NAME=PATH` (before the model's weights, so a refused adapter
costs no load), every one checked before any is kept: a bad entry stops the executor with a
configuration error naming it (exit 2), never a half-loaded set. A plan that names an adapter the
executor does not hold is refused before it changes anything (a step error naming it).
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from kvserve.executor.config_error import ExecutorConfigError
from kvserve.executor.lora.adapter import LoraAdapter
from kvserve.executor.lora.adapter_spec import parse_adapter_specs
from kvserve.executor.lora.peft_weights import load_peft_adapter
from kvserve.executor.lora.slots import AdapterSlots
from kvserve.executor.lora.step_deltas import LoraStep, lora_step, rows_by_adapter
from kvserve.executor.model_config import ModelConfig
from kvserve.executor.process_memory import MIB
from kvserve.executor.runner_config import RunnerConfig
from kvserve.protos.step import NewSequence, PlanError

log = structlog.get_logger(__name__)


class AdapterSet:
    """The loaded adapters (possibly none), in the order given; an adapter's index is its place there."""

    def __init__(self, adapters: Sequence[LoraAdapter], max_loras: int, device: str) -> None:
        self.names = [adapter.name for adapter in adapters]
        self.indices = {name: index for index, name in enumerate(self.names)}
        """Name -> index, what `build_input_batch` marks each token with."""
        self.slots = AdapterSlots(adapters, max_loras, device)
        self.device = device

    def check_plan(self, new_seqs: Sequence[NewSequence]) -> None:
        """Refuse a plan naming an adapter not loaded, before it changes anything."""
        for seq in new_seqs:
            if seq.lora_name and seq.lora_name not in self.indices:
                loaded = ", ".join(repr(n) for n in self.names) if self.names else "none (no --lora given)"
                raise PlanError(
                    f"sequence {seq.seq_id}: LoRA adapter {seq.lora_name!r} is not loaded in this executor; "
                    f"loaded: {loaded}"
                )

    def step(self, token_adapters: Sequence[int] | None) -> LoraStep | None:
        """The deltas of a step whose tokens run under `token_adapters` (per token an index, -1: the
        base model); None when no token has an adapter."""
        if token_adapters is None:
            return None
        groups = rows_by_adapter(token_adapters)
        if not groups:
            return None
        return lora_step(groups, self.slots.acquire(list(groups)), self.device)


def load_adapter_set(config: RunnerConfig, model: ModelConfig, device: str, ranks: int = 1) -> AdapterSet:
    """Every `--lora` adapter checked and loaded for `model` (`ranks`: the tensor-parallel size)."""
    if not config.lora:
        return AdapterSet([], 1, device)
    if ranks > 1:
        raise ExecutorConfigError("--lora runs on one executor: it cannot be combined with tensor parallelism")
    if config.max_loras < 1 or config.max_lora_rank < 1:
        raise ExecutorConfigError(
            f"--max-loras and --max-lora-rank must be at least 1, got {config.max_loras} and {config.max_lora_rank}"
        )
    adapters = [load_peft_adapter(spec, model, config.max_lora_rank) for spec in parse_adapter_specs(config.lora)]
    pin = device.startswith("cuda")
    adapters = [adapter.to("cpu", pin=pin) for adapter in adapters] if pin else adapters
    loaded = AdapterSet(adapters, min(config.max_loras, len(adapters)), device)
    log.info(
        "loaded LoRA adapters",
        names=",".join(loaded.names),
        ranks=",".join(str(a.rank) for a in adapters),
        host_mib=round(sum(a.nbytes for a in adapters) / MIB, 1),
        max_loras=config.max_loras,
        slot_mib=round(loaded.slots.nbytes / MIB, 1),
    )
    return loaded
