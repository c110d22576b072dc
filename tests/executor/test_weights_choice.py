"""`--weights`: what each value resolves to, and the combinations refused at start-up by name."""

from __future__ import annotations

import pytest

from executor_svc.runner_config import RunnerConfig, resolve_weights


def test_auto_and_dequantized_keep_the_converted_weights() -> None:
    assert resolve_weights(RunnerConfig(), "cpu", "float32") == "dequantized"
    assert resolve_weights(RunnerConfig(weights="dequantized"), "cuda", "bfloat16") == "dequantized"
    assert resolve_weights(RunnerConfig(weights="native"), "cpu", "float32") == "native"


@pytest.mark.parametrize(
    ("weights", "device", "dtype", "message"),
    [
        ("native", "cuda", "bfloat16", "runs on cpu with --dtype float32"),
        ("native", "cpu", "bfloat16", "runs on cpu with --dtype float32"),
        ("int8", "cpu", "float32", "must be auto, dequantized or native"),
    ],
)
def test_refused_combinations_say_why(weights: str, device: str, dtype: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_weights(RunnerConfig(weights=weights), device, dtype)


def test_native_refuses_a_model_that_is_not_a_gguf(tmp_path) -> None:
    from executor_svc.model_runner import ModelRunner

    (tmp_path / "config.json").write_text("{}")
    runner = object.__new__(ModelRunner)  # only the source check, without loading a model
    runner.config = RunnerConfig(model=str(tmp_path), weights="native")
    with pytest.raises(ValueError, match="needs a GGUF model"):
        runner._native_linears()
