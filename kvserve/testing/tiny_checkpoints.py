"""Tiny random Llama / Mistral / Qwen2 checkpoints, written by transformers itself, for tests.

Nothing is downloaded: each is `XForCausalLM(config)` from a seeded generator, saved with
`save_pretrained`. `with_tokenizer` copies a served model's tokenizer files beside it, so
`kvserve serve --model DIR` can run it (its vocabulary must then cover the tokenizer's).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)

SHARDABLE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=96,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=12,
    num_key_value_heads=6,
    head_dim=8,
    max_position_embeddings=256,
)
"""A tiny shape for tensor-parallel tests: its heads and MLP width divide by 2, 3 and 6, and a
vocabulary of 256 pads to 3 × 86 rows at 3 ranks."""


TINY: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
"""The smallest shape the loaders and kernels meet in full: GQA (4 heads over 2), 16-wide heads."""

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tied-llama3-rope": (
        "llama",
        dict(
            tie_word_embeddings=True,
            rope_theta=5000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral": ("mistral", dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2-qkv-bias": ("qwen2", dict(tie_word_embeddings=False)),
}
"""(architecture, config overrides of TINY): every rope scaling, tied and untied heads, q/k/v biases."""

PROMPTS = [[(7 * i + j) % 256 for j in range(n)] for i, n in enumerate((5, 16, 23, 40))]
"""Token prompts for TINY models: shorter than, equal to and spanning several 16-token blocks."""


def tiny_checkpoint(directory: Path, arch: str, **overrides: Any) -> tuple[Any, Path]:
    """A TINY `arch` model with `overrides`, and the directory (`directory / arch`) it is saved in."""
    model = build_tiny_model(arch, **(TINY | overrides))
    path = directory / arch
    model.save_pretrained(path)
    return model, path


def write_tiny_checkpoint(path: Path, arch: str = "llama", *, seed: int = 0, **config: Any) -> Path:
    """A random `arch` model of `config` (transformers config fields) saved in `path`; returns `path`."""
    build_tiny_model(arch, seed=seed, **config).save_pretrained(path)
    return path


def build_tiny_model(arch: str = "llama", *, seed: int = 0, **config: Any) -> Any:
    """transformers' own `arch` model of `config`, seeded, in eval mode (for tests that compare against it)."""
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**config)).eval()
    if arch == "qwen2":  # random init leaves the q/k/v biases at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_()
    return model


def with_tokenizer(path: Path, tokenizer_dir: Path) -> Path:
    """Copy `tokenizer_dir`'s tokenizer files (those it has) into checkpoint `path`; returns `path`."""
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)
    return path
