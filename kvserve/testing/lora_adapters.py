"""LoRA adapters in PEFT's saved layout, written without PEFT, for tests and benchmarks.

`write_lora_adapter` writes what `PeftModel.save_pretrained` writes for a LoRA adapter of a Llama
model: `adapter_config.json` and `adapter_model.safetensors` with keys like
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`. A and B are random and non-zero
(PEFT starts B at zero, which would make every adapter the base model). `config` and `tensors`
let a test break one thing at a time, to check the executor's refusals.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvserve.executor.lora.adapter import projection_shapes
from kvserve.executor.lora.peft_config import SUPPORTED_TARGETS
from kvserve.executor.lora.peft_weights import PROJECTION_BLOCKS
from kvserve.executor.model_config import ModelConfig


def lora_key(layer: int, projection: str, half: str) -> str:
    """PEFT's saved name of a projection's lora_A or lora_B weight (`half`: "A" or "B")."""
    return f"base_model.model.model.layers.{layer}.{PROJECTION_BLOCKS[projection]}.{projection}.lora_{half}.weight"


def write_lora_adapter(
    path: Path,
    model: ModelConfig,
    *,
    rank: int = 8,
    alpha: float = 16,
    targets: Sequence[str] = SUPPORTED_TARGETS,
    seed: int = 0,
    b_std: float = 0.02,
    config: dict[str, Any] | None = None,
    tensors: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> Path:
    """A random rank-`rank` adapter of `model` on `targets` in every layer, saved in `path`; returns
    `path`. `config`: adapter_config.json fields to set over PEFT's; `tensors`: edits the weights
    before they are saved."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(model.num_layers):
        for projection in targets:
            n_in, n_out = projection_shapes(model)[projection]
            weights[lora_key(layer, projection, "A")] = torch.randn(rank, n_in, generator=generator) / n_in**0.5
            weights[lora_key(layer, projection, "B")] = torch.randn(n_out, rank, generator=generator) * b_std
    if tensors is not None:
        weights = tensors(weights)
    fields: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    } | (config or {})
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(fields, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "adapter_model.safetensors"))
    return path
