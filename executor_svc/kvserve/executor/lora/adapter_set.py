"""What the runner holds of LoRA: the adapters by name, their slots, and each step's deltas.

Loaded at start-up from `--lora NAME=PATH` (before the model's weights, so a refused adapter
costs no load), every one checked before any is kept: a bad entry stops the executor with a
configuration error naming it (exit 2), never a half-loaded set. At run time (the scheduler's
`--allow-runtime-lora`) `adding` and `removing` give a new set between steps, the old one untouched
until the new one is whole: a refused adapter leaves what was loaded as it was. A plan that names
an adapter the executor does not hold is refused before it changes anything (a step error naming it).
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from kvserve.executor.config_error import ExecutorConfigError
from kvserve.executor.lora.adapter import LoraAdapter
from kvserve.executor.lora.adapter_spec import AdapterSpec, parse_adapter_specs
from kvserve.executor.lora.peft_weights import load_peft_adapter
from kvserve.executor.lora.slots import AdapterSlots
from kvserve.executor.lora.step_deltas import LoraStep, lora_step, rows_by_adapter
from kvserve.executor.model_config import ModelConfig
from kvserve.executor.process_memory import MIB
from kvserve.executor.runner_config import RunnerConfig
from kvserve.protos.step import NewSequence, PlanError

log = structlog.get_logger(__name__)

TENSOR_PARALLEL_REFUSAL = "LoRA adapters run on one executor: they cannot be combined with tensor parallelism"


class AdapterSet:
    """The loaded adapters (possibly none), in the order given; an adapter's index is its place there."""

    def __init__(self, adapters: Sequence[LoraAdapter], max_loras: int, device: str) -> None:
        self.adapters = list(adapters)
        """Host copies (pinned on CUDA), in the order loaded."""
        self.names = [adapter.name for adapter in adapters]
        self.indices = {name: index for index, name in enumerate(self.names)}
        """Name -> index, what `build_input_batch` marks each token with."""
        self.max_loras = max_loras
        self.slots = AdapterSlots(adapters, max(1, min(max_loras, len(self.adapters))), device)
        self.device = device

    def adding(self, spec: AdapterSpec, model: ModelConfig, max_rank: int) -> AdapterSet:
        """This set and the adapter `spec` names, checked as at start-up (ExecutorConfigError names the
        problem). Slots are rebuilt, sized for the new set: an adapter is copied in at its next step."""
        if spec.name in self.indices:
            raise ExecutorConfigError(f"LoRA adapter {spec.name!r}: the name is taken by a loaded adapter")
        adapter = _on_host(load_peft_adapter(spec, model, max_rank), self.device)
        log.info("loaded LoRA adapter", name=spec.name, rank=adapter.rank, host_mib=round(adapter.nbytes / MIB, 1))
        return AdapterSet([*self.adapters, adapter], self.max_loras, self.device)

    def removing(self, name: str) -> AdapterSet:
        """This set without the adapter `name` (ExecutorConfigError: none is loaded under it)."""
        if name not in self.indices:
            raise ExecutorConfigError(f"LoRA adapter {name!r} is not loaded; loaded: {self._loaded()}")
        log.info("unloaded LoRA adapter", name=name)
        return AdapterSet([a for a in self.adapters if a.name != name], self.max_loras, self.device)

    def _loaded(self) -> str:
        return ", ".join(repr(n) for n in self.names) if self.names else "none"

    def check_plan(self, new_seqs: Sequence[NewSequence]) -> None:
        """Refuse a plan naming an adapter not loaded, before it changes anything."""
        for seq in new_seqs:
            if seq.lora_name and seq.lora_name not in self.indices:
                raise PlanError(
                    f"sequence {seq.seq_id}: LoRA adapter {seq.lora_name!r} is not loaded in this executor; "
                    f"loaded: {self._loaded()}"
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
    if config.max_loras < 1 or config.max_lora_rank < 1:
        raise ExecutorConfigError(
            f"--max-loras and --max-lora-rank must be at least 1, got {config.max_loras} and {config.max_lora_rank}"
        )
    if not config.lora:
        return AdapterSet([], config.max_loras, device)
    if ranks > 1:
        raise ExecutorConfigError(TENSOR_PARALLEL_REFUSAL)
    specs = parse_adapter_specs(config.lora)
    adapters = [_on_host(load_peft_adapter(spec, model, config.max_lora_rank), device) for spec in specs]
    loaded = AdapterSet(adapters, config.max_loras, device)
    log.info(
        "loaded LoRA adapters",
        names=",".join(loaded.names),
        ranks=",".join(str(a.rank) for a in adapters),
        host_mib=round(sum(a.nbytes for a in adapters) / MIB, 1),
        max_loras=config.max_loras,
        slot_mib=round(loaded.slots.nbytes / MIB, 1),
    )
    return loaded


def _on_host(adapter: LoraAdapter, device: str) -> LoraAdapter:
    """The adapter's host copy: as loaded on a CPU executor, in pinned memory for a CUDA one (its
    copies into the slots are then asynchronous)."""
    return adapter.to("cpu", pin=True) if device.startswith("cuda") else adapter
