"""An adapter's `adapter_model.safetensors` as PEFT saves it, checked against the base model.

PEFT names each tensor after the module it adapts, under its own wrapper:
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]). Every tensor must be such a pair's half, of a layer and projection the base model has,
in the shapes the base model's projection takes: an adapter trained on another base model, on
other modules (the embedding, the output head), or a file cut short is refused at start-up with
the adapter's name and the first tensor that does not fit, never served as whatever it would compute.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvserve.executor.config_error import ExecutorConfigError
from kvserve.executor.lora.adapter import LoraAdapter, pack_layer, projection_shapes
from kvserve.executor.lora.adapter_spec import AdapterSpec
from kvserve.executor.lora.peft_config import SUPPORTED_TARGETS, LoraSettings, read_settings
from kvserve.executor.model_config import ModelConfig

WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<half>[AB])\.weight")
_LAYER_MODULE = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<projection>\w+)")
PROJECTION_BLOCKS = dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), "self_attn") | dict.fromkeys(
    ("gate_proj", "up_proj", "down_proj"), "mlp"
)
"""The decoder-layer block each target projection lives in, as in PEFT's saved key names."""


def load_peft_adapter(spec: AdapterSpec, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """The adapter `spec` names, on the host in float32, in the forward pass's fused layout."""
    settings = read_settings(spec.name, spec.path, max_rank)
    tensors = _read(spec, spec.path / WEIGHTS_FILE)
    pairs = _pairs(spec.name, tensors, config, settings)
    layers = [pack_layer(pairs.get(i, {}), config) for i in range(config.num_layers)]
    return LoraAdapter(spec.name, settings.rank, settings.scaling, layers)


def _read(spec: AdapterSpec, path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ExecutorConfigError(
            f"LoRA adapter {spec.name!r}: {path} is missing (expected a directory PEFT's save_pretrained wrote)"
        )
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error type for a truncated or foreign file
        raise ExecutorConfigError(f"LoRA adapter {spec.name!r}: {path} cannot be read as safetensors ({exc})") from None


def _pairs(
    name: str, tensors: dict[str, torch.Tensor], config: ModelConfig, settings: LoraSettings
) -> dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(A, B) per layer and projection, every tensor accounted for and every shape checked."""

    def refuse(problem: str) -> ExecutorConfigError:
        return ExecutorConfigError(f"LoRA adapter {name!r}: {problem}")

    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        module = match["module"] if match else key.removeprefix("base_model.model.").split(".lora_")[0]
        place = _LAYER_MODULE.fullmatch(module) if match else None
        projection = place["projection"] if place else module.rsplit(".", 1)[-1]
        if place is None or projection not in SUPPORTED_TARGETS or PROJECTION_BLOCKS[projection] != place["block"]:
            raise refuse(
                f"holds {key!r}: kvserve adds LoRA deltas to {', '.join(SUPPORTED_TARGETS)} of the decoder layers "
                f"only (not {module!r})"
            )
        assert match is not None
        layer = int(place["layer"])
        if layer >= config.num_layers:
            raise refuse(
                f"holds {key!r} but the base model has {config.num_layers} layers: it was trained on another base model"
            )
        if not tensor.is_floating_point():
            raise refuse(f"{key!r} is {tensor.dtype}, not a floating-point tensor")
        halves.setdefault((layer, projection), {})[match["half"]] = tensor
    if not halves:
        raise refuse(f"{WEIGHTS_FILE} holds no LoRA weights")
    shapes = projection_shapes(config)
    pairs: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, projection), pair in sorted(halves.items()):
        where = f"layer {layer} {projection}"
        if len(pair) != 2:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise refuse(f"{where} has no {missing} weight: {WEIGHTS_FILE} is incomplete")
        a, b = pair["A"], pair["B"]
        n_in, n_out = shapes[projection]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or b.shape[0] != n_out or a.shape[0] != b.shape[1]:
            raise refuse(
                f"{where} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; this base model needs "
                f"[r, {n_in}] and [{n_out}, r]: the adapter was trained on another base model"
            )
        if a.shape[0] != settings.rank:
            raise refuse(f"{where} has rank {a.shape[0]} but adapter_config.json says r={settings.rank}")
        pairs.setdefault(layer, {})[projection] = (a.float(), b.float())
    return pairs
