"""The Llama-family hyper-parameters kvserve needs, read from an HF `config.json`.

Only architectures whose forward pass `kvserve.executor.model.llama` implements exactly are
accepted; anything else fails at load time with an error naming the architecture,
rather than producing subtly wrong tokens later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The model directory holds an architecture or option the runner does not implement."""


@dataclass(slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope: RopeConfig
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied), for FLOP estimates."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + lm_head


def load_model_config(model_dir: Path) -> ModelConfig:
    """Parse `config.json` (and `generation_config.json` for extra EOS ids)."""
    raw = json.loads((model_dir / "config.json").read_text())
    archs = raw.get("architectures") or [raw.get("model_type", "<missing>")]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported model architecture {arch!r}; kvserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {raw['hidden_act']!r} for {arch}; only silu")
    num_heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
    attention_bias = bool(raw.get("attention_bias", False)) or arch == "Qwen2ForCausalLM"
    sliding = raw.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        sliding = None
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        rope=_rope_config(raw),
        sliding_window=int(sliding) if sliding else None,
        eos_token_ids=_eos_ids(raw, model_dir),
    )


def _rope_config(raw: dict) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older configs use rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope_type {rope_type!r}; kvserve supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(raw: dict, model_dir: Path) -> list[int]:
    ids: list[int] = []
    sources = [raw.get("eos_token_id")]
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids
