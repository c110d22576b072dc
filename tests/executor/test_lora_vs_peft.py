"""The executor's LoRA adapters on the real default model give PEFT's greedy tokens, token for token.

Two adapters are made with PEFT itself on transformers' model of the default checkpoint: rank 8
(lora_alpha / r scaling) and rank 16 (rsLoRA's lora_alpha / sqrt(r)), on all seven projections,
lora_B drawn at random (PEFT starts it at zero, which would make the adapter the base model), and
saved with `save_pretrained`. The runner (float32, dequantized weights) serves both adapters and the
base model in the same steps; the `PeftModel` at float32 must choose each of its greedy tokens, after
every prefix of them (all prompts) and decoding alone with `generate` (the first `GENERATED`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.executor.model_config import load_model_config
from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.runner_config import RunnerConfig
from kvserve.testing.lora_adapters import write_lora_adapter
from kvserve.testing.plan_driver import PlanDriver

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"r8": dict(r=8, lora_alpha=16), "r16": dict(r=16, lora_alpha=8, use_rslora=True)}
B_STD = 0.05
GENERATED = 2
"""Prompts per adapter also decoded by `PeftModel.generate` (a token at a time: about 1.5 s a prompt)."""
"""lora_B's spread: enough to change most greedy continuations, not so much that they become noise."""
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea and the wind, in the style of a children's song:",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Question: What is the boiling point of water at sea level in degrees Celsius?\nAnswer:",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "List three benefits of regular exercise for office workers:\n1.",
    "Translate to French: 'Good morning, how are you today?'",
    "The quick brown fox jumps over the lazy dog. Then the fox",
    "My favourite recipe for a rainy Sunday afternoon is",
    "SELECT name, age FROM users WHERE",
    "The three primary colours are",
    "Dear hiring manager, I am writing to apply for the position of",
]


@pytest.fixture(scope="module")
def prompt_ids(default_model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def peft_model(default_model_dir, tmp_path_factory) -> tuple[Any, Path]:
    """transformers' model of the default checkpoint with both adapters (PEFT's own), and where they are
    saved (`<dir>/<name>`, as `save_pretrained` lays out a model's several adapters)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model: Any = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    for name, settings in ADAPTERS.items():
        config = LoraConfig(target_modules=TARGETS, lora_dropout=0.0, **settings)
        if isinstance(model, PeftModel):
            model.add_adapter(name, config)
        else:
            model = get_peft_model(model, config, adapter_name=name)
    generator = torch.Generator().manual_seed(100)
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "lora_B" in parameter_name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * B_STD)
    saved = tmp_path_factory.mktemp("peft")
    model.save_pretrained(saved)
    return model.eval(), saved


@pytest.fixture(scope="module")
def runner(peft_model) -> Iterator[ModelRunner]:
    lora = tuple(f"{name}={peft_model[1] / name}" for name in ADAPTERS)
    runner = ModelRunner(RunnerConfig(dtype="float32", weights="dequantized", kv_cache_gb=0.25, lora=lora))
    yield runner
    runner.close()


def test_the_test_adapters_writer_saves_what_peft_saves(default_model_dir, peft_model, tmp_path) -> None:
    """`kvserve.testing.lora_adapters`, which the other LoRA tests use, against PEFT's own files."""
    from safetensors import safe_open

    peft_dir = peft_model[1] / "r8"
    ours = write_lora_adapter(tmp_path / "ours", load_model_config(default_model_dir), rank=8, alpha=16)
    shapes = []
    for directory in (peft_dir, ours):
        with safe_open(str(directory / "adapter_model.safetensors"), framework="pt") as f:
            shapes.append({key: f.get_slice(key).get_shape() for key in f.keys()})  # noqa: SIM118
    assert shapes[0] == shapes[1]
    configs = [json.loads((d / "adapter_config.json").read_text()) for d in (peft_dir, ours)]
    for key in ("peft_type", "r", "lora_alpha", "bias", "use_rslora", "use_dora", "modules_to_save"):
        assert configs[0][key] == configs[1][key], key
    assert sorted(configs[0]["target_modules"]) == sorted(configs[1]["target_modules"])


def test_greedy_tokens_match_peft_with_both_adapters_and_the_base_model_in_one_batch(
    runner, prompt_ids, peft_model
) -> None:
    """kvserve's greedy tokens, then PEFT's next-token choice at every position of them (teacher forcing:
    one forward per prompt instead of one per token). Greedy decoding gives the same tokens exactly when
    PEFT's argmax after each prefix is kvserve's next token."""
    model = peft_model[0]
    driver = PlanDriver(runner)
    names = ["", *ADAPTERS]
    for a, adapter in enumerate(names):
        for i, ids in enumerate(prompt_ids):
            driver.add(a * 100 + i, ids, NEW_TOKENS, lora_name=adapter)
    ours = driver.run()
    base = [ours[i] for i in range(len(PROMPTS))]
    for a, adapter in enumerate(names[1:], start=1):
        model.set_adapter(adapter)
        for i, ids in enumerate(prompt_ids):
            tokens = ours[a * 100 + i]
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :]
            chosen = logits.argmax(-1).tolist()
            if chosen != tokens:
                at = next(t for t, (c, o) in enumerate(zip(chosen, tokens)) if c != o)
                top = logits[at].topk(2).values
                pytest.fail(
                    f"{adapter}, prompt {i}, token {at}: kvserve chose {tokens[at]}, PEFT {chosen[at]} (PEFT's top "
                    f"two logits {top[0]:.6f} and {top[1]:.6f}, kvserve's token at {logits[at, tokens[at]]:.6f})"
                )
        for i in range(GENERATED):  # and PEFT's own greedy decoding, step by step over its KV cache
            input_ids = torch.tensor([prompt_ids[i]])
            with torch.inference_mode():
                generated = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    do_sample=False,
                    max_new_tokens=NEW_TOKENS,
                    pad_token_id=model.config.eos_token_id,
                )
            expected = generated[0, input_ids.shape[1] :].tolist()
            assert ours[a * 100 + i][: len(expected)] == expected, f"{adapter}, prompt {i}: PEFT's generate differs"
        # The adapter matters: most continuations differ from the base model's.
        assert sum(ours[a * 100 + i] != base[i] for i in range(len(PROMPTS))) >= len(PROMPTS) * 2 // 3
