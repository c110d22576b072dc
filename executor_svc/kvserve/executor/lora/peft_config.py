"""An adapter's `adapter_config.json` as PEFT writes it: its rank, its scaling, and the features refused.

Why refuse rather than ignore: a feature the forward pass does not apply (DoRA's magnitude vectors,
trained biases, whole retrained modules, per-module ranks or alphas, another method's settings)
would silently give other tokens than the fine-tune was trained to give. An adapter is served
exactly, or refused at start-up with its name and the field that stops it.

The scaling is PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.executor.config_error import ExecutorConfigError

CONFIG_FILE = "adapter_config.json"
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections a LoRA delta may be added to: every linear layer of a decoder layer."""
ALL_LINEAR = "all-linear"
"""PEFT's shorthand for every linear layer but the output head: `SUPPORTED_TARGETS` here."""
UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA, weight-decomposed LoRA",
    "lora_bias": "trained LoRA biases",
    "fan_in_fan_out": "transposed (Conv1D) weights",
    "modules_to_save": "whole retrained modules",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "layer_replication": "replicated layers",
    "target_parameters": "LoRA on parameters rather than modules",
    "trainable_token_indices": "trained token embeddings",
    "alora_invocation_tokens": "activated LoRA",
    "use_qalora": "QA-LoRA's pooled inputs",
    "use_bdlora": "block-diagonal LoRA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
}
"""adapter_config.json fields that change what the adapter computes, refused when set (true, or non-empty).
Fields that only say how the adapter was initialised or trained (dropout, init_lora_weights, ...) are ignored."""


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """What the forward pass needs from adapter_config.json."""

    rank: int
    alpha: float
    use_rslora: bool

    @property
    def scaling(self) -> float:
        """The factor PEFT multiplies each delta by (`LoraLayer.update_layer`)."""
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank


def read_settings(name: str, directory: Path, max_rank: int) -> LoraSettings:
    """adapter_config.json in `directory`, checked; `name` is the adapter's, for the messages."""
    path = directory / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExecutorConfigError(
            f"LoRA adapter {name!r}: {path} is missing (expected a directory PEFT's save_pretrained wrote)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExecutorConfigError(f"LoRA adapter {name!r}: {path} cannot be read as JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ExecutorConfigError(f"LoRA adapter {name!r}: {path} is not a JSON object")
    return _settings(name, raw, max_rank)


def _settings(name: str, raw: dict[str, Any], max_rank: int) -> LoraSettings:
    def refuse(problem: str) -> ExecutorConfigError:
        return ExecutorConfigError(f"LoRA adapter {name!r}: {problem}")

    kind = raw.get("peft_type", "LORA")
    if kind != "LORA":
        raise refuse(f"is a {kind} adapter (peft_type); only LORA adapters are served")
    for field, feature in UNSUPPORTED_FIELDS.items():
        value = raw.get(field)
        if value:
            raise refuse(f"uses {feature} ({field}={value!r}), which kvserve does not apply")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise refuse(f"trains biases (bias={bias!r}); only bias='none' is served")
    _check_targets(raw.get("target_modules"), refuse)
    rank, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)  # PEFT's LoraConfig defaults
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse(f"r={rank!r} in adapter_config.json is not a positive integer")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise refuse(f"lora_alpha={alpha!r} in adapter_config.json is not a number")
    if rank > max_rank:
        raise refuse(f"its rank {rank} is over --max-lora-rank {max_rank}")
    return LoraSettings(rank, float(alpha), bool(raw.get("use_rslora", False)))


def _check_targets(targets: object, refuse: Any) -> None:
    """A list of module names must name only `SUPPORTED_TARGETS` (by their last component, as PEFT
    matches them). A regular expression is left to the weights: each tensor names its module."""
    if targets is None or isinstance(targets, str):
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise refuse(f"target_modules={targets!r} is neither a list of module names nor a pattern")
    for target in targets:
        if target != ALL_LINEAR and target.rsplit(".", 1)[-1] not in SUPPORTED_TARGETS:
            raise refuse(
                f"targets {target!r}; kvserve adds LoRA deltas to {', '.join(SUPPORTED_TARGETS)} only "
                "(not the embedding or the output head)"
            )
