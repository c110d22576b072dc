"""`--lora` entries the executor refuses at start-up, each with the adapter's name and the problem.

Every refusal is an `ExecutorConfigError` (`kvserve executor` exits 2 with its one line), raised
before the model's weights are read. The adapters are written in PEFT's layout for a tiny model
(`kvserve.testing.lora_adapters`), each with one thing wrong.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.executor.config_error import ExecutorConfigError
from kvserve.executor.lora.adapter_set import load_adapter_set
from kvserve.executor.model_config import ModelConfig, load_model_config
from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.runner_config import RunnerConfig
from kvserve.testing.lora_adapters import lora_key, write_lora_adapter
from kvserve.testing.tiny_checkpoints import TINY, write_tiny_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama", **TINY)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> ModelConfig:
    return load_model_config(model_dir)


def _load(model: ModelConfig, *lora: str, ranks: int = 1, **config: Any) -> None:
    load_adapter_set(RunnerConfig(lora=lora, **config), model, "cpu", ranks)


def test_good_adapters_load_with_their_scaling(tmp_path: Path, model: ModelConfig) -> None:
    plain = write_lora_adapter(tmp_path / "plain", model, rank=8, alpha=16)
    rs = write_lora_adapter(tmp_path / "rs", model, rank=16, alpha=8, config={"use_rslora": True})
    loaded = load_adapter_set(RunnerConfig(lora=(f"p={plain}", f"r={rs}"), max_loras=1), model, "cpu")
    assert loaded.names == ["p", "r"]
    assert [a.scaling for a in loaded.slots.adapters] == [2.0, 2.0]  # 16 / 8 and 8 / sqrt(16)
    assert loaded.slots.capacity == 1


@pytest.mark.parametrize("entry", ["adapter", "=/some/dir", "name=", ""])
def test_an_entry_that_is_not_name_equals_path_is_refused(model: ModelConfig, entry: str) -> None:
    with pytest.raises(ExecutorConfigError, match=rf"--lora '{entry}': expected NAME=PATH"):
        _load(model, entry)


def test_a_name_given_twice_is_refused_before_any_file_is_read(model: ModelConfig) -> None:
    with pytest.raises(ExecutorConfigError, match=r"the name 'sql' is given twice \(/a and /b\)"):
        _load(model, "sql=/a", "sql=/b")


def test_missing_and_corrupt_files_are_refused(tmp_path: Path, model: ModelConfig) -> None:
    with pytest.raises(ExecutorConfigError, match=r"LoRA adapter 'gone': .*/nowhere/adapter_config.json is missing"):
        _load(model, f"gone={tmp_path / 'nowhere'}")
    good = write_lora_adapter(tmp_path / "good", model)
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "adapter_config.json").write_bytes((good / "adapter_config.json").read_bytes())
    with pytest.raises(ExecutorConfigError, match=r"LoRA adapter 'w': .*adapter_model.safetensors is missing"):
        _load(model, f"w={tmp_path / 'no-weights'}")
    bad_json = write_lora_adapter(tmp_path / "bad-json", model)
    (bad_json / "adapter_config.json").write_text('{"r": 8,')
    with pytest.raises(ExecutorConfigError, match=r"LoRA adapter 'j': .*adapter_config.json cannot be read as JSON"):
        _load(model, f"j={bad_json}")
    cut = write_lora_adapter(tmp_path / "cut", model)
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ExecutorConfigError, match=r"LoRA adapter 'c': .*cannot be read as safetensors"):
        _load(model, f"c={cut}")


def test_an_adapter_of_another_base_model_is_refused(tmp_path: Path, model: ModelConfig) -> None:
    other = replace(model, hidden_size=96)
    path = write_lora_adapter(tmp_path / "other", other)
    with pytest.raises(
        ExecutorConfigError,
        match=r"LoRA adapter 'other': layer 0 down_proj has lora_A \[8, 96\] and lora_B \[96, 8\]; this base model "
        r"needs \[r, 96\] and \[64, r\]: the adapter was trained on another base model",
    ):
        _load(model, f"other={path}")
    deeper = write_lora_adapter(tmp_path / "deeper", replace(model, num_layers=4))
    with pytest.raises(ExecutorConfigError, match=r"'deep': holds '.*layers.2.*' but the base model has 2 layers"):
        _load(model, f"deep={deeper}")


def test_a_rank_over_max_lora_rank_is_refused(tmp_path: Path, model: ModelConfig) -> None:
    path = write_lora_adapter(tmp_path / "big", model, rank=32)
    with pytest.raises(ExecutorConfigError, match=r"LoRA adapter 'big': its rank 32 is over --max-lora-rank 16"):
        _load(model, f"big={path}")
    _load(model, f"big={path}", max_lora_rank=32)


def _drop_b(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    del weights[lora_key(1, "v_proj", "B")]
    return weights


def _add_lm_head(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return weights | {
        "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
        "base_model.model.lm_head.lora_B.weight": torch.zeros(256, 8),
    }


def _other_rank(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    weights[lora_key(0, "q_proj", "A")] = torch.zeros(4, 64)
    weights[lora_key(0, "q_proj", "B")] = torch.zeros(64, 4)
    return weights


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        ({"target_modules": ["q_proj", "embed_tokens"]}, None, "targets 'embed_tokens'; kvserve adds LoRA deltas to"),
        ({"target_modules": ["lm_head"]}, None, "targets 'lm_head'"),
        ({"target_modules": ".*proj|lm_head"}, _add_lm_head, "holds 'base_model.model.lm_head.lora_A.weight'"),
        ({"use_dora": True}, None, r"uses DoRA, weight-decomposed LoRA \(use_dora=True\), which kvserve does not"),
        ({"bias": "all"}, None, r"trains biases \(bias='all'\); only bias='none' is served"),
        ({"bias": "lora_only"}, None, r"trains biases \(bias='lora_only'\)"),
        ({"modules_to_save": ["lm_head"]}, None, r"uses whole retrained modules \(modules_to_save=\['lm_head'\]\)"),
        ({"rank_pattern": {"q_proj": 4}}, None, r"uses per-module ranks \(rank_pattern=\{'q_proj': 4\}\)"),
        ({"peft_type": "IA3"}, None, r"is a IA3 adapter \(peft_type\); only LORA adapters are served"),
        (None, _drop_b, "layer 1 v_proj has no lora_B weight: adapter_model.safetensors is incomplete"),
        (None, _other_rank, "layer 0 q_proj has rank 4 but adapter_config.json says r=8"),
        (None, lambda w: {}, "adapter_model.safetensors holds no LoRA weights"),
    ],
    ids=[
        "embedding", "lm_head", "lm_head-weights", "dora", "bias-all", "bias-lora-only", "modules-to-save",
        "rank-pattern", "not-lora", "half-missing", "rank-mismatch", "empty",
    ],
)  # fmt: skip
def test_unsupported_targets_and_features_are_refused(
    tmp_path: Path,
    model: ModelConfig,
    config: dict[str, Any] | None,
    tensors: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None,
    message: str,
) -> None:
    path = write_lora_adapter(tmp_path / "bad", model, config=config, tensors=tensors)
    with pytest.raises(ExecutorConfigError, match=f"LoRA adapter 'bad': {message}"):
        _load(model, f"bad={path}")


def test_tensor_parallelism_and_zero_slots_are_refused(tmp_path: Path, model: ModelConfig) -> None:
    path = write_lora_adapter(tmp_path / "a", model)
    with pytest.raises(
        ExecutorConfigError, match="LoRA adapters run on one executor: they cannot be combined with tensor"
    ):
        _load(model, f"a={path}", ranks=2)
    with pytest.raises(ExecutorConfigError, match="--max-loras and --max-lora-rank must be at least 1, got 0 and 16"):
        _load(model, f"a={path}", max_loras=0)


def test_the_runner_refuses_before_loading_the_model(tmp_path: Path, model_dir: Path, model: ModelConfig) -> None:
    good = write_lora_adapter(tmp_path / "good", model)
    bad = write_lora_adapter(tmp_path / "bad", model, config={"use_dora": True})
    with pytest.raises(ExecutorConfigError, match="LoRA adapter 'b': uses DoRA"):
        ModelRunner(RunnerConfig(model=str(model_dir), dtype="float32", lora=(f"g={good}", f"b={bad}")))


def test_kvserve_executor_reports_a_refused_adapter_and_exits_2(tmp_path: Path, model_dir: Path) -> None:
    missing = tmp_path / "no-such-adapter"
    result = subprocess.run(
        [sys.executable, "-m", "kvserve", "executor", "--model", str(model_dir), "--lora", f"sql={missing}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"LoRA adapter 'sql': {missing}/adapter_config.json is missing" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
