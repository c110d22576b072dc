"""`--weights` and `--dtype`: what each value resolves to, and the combinations refused by name."""

from __future__ import annotations

import pytest

from kvserve.executor import cpu_features
from kvserve.executor.model_config import ModelConfig, RopeConfig
from kvserve.executor.runner_config import RunnerConfig, resolve_dtype, resolve_weights
from kvserve.executor.weights.gguf_weights import native_linears_or_none

SMOLLM2_SHAPE = ModelConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192,
    tie_word_embeddings=True, attention_bias=False, rope=RopeConfig(),
)  # fmt: skip


def test_dequantized_and_native_are_kept_as_asked() -> None:
    assert resolve_weights(RunnerConfig(weights="dequantized"), "cuda") == "dequantized"
    assert resolve_weights(RunnerConfig(weights="dequantized"), "cpu") == "dequantized"
    assert resolve_weights(RunnerConfig(weights="native"), "cpu") == "native"
    assert resolve_weights(RunnerConfig(weights="native", dtype="float32"), "cpu") == "native"


ZEN3 = {"avx2", "fma"}
ZEN4 = {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"}
AMX_XEON = ZEN4 | {"amx_tile", "amx_int8", "amx_bf16"}


@pytest.mark.parametrize(
    ("flags", "dtype_flag", "device", "ranks", "gguf", "expected"),
    [
        (ZEN3, "auto", "cpu", 1, True, "native"),  # measured faster at every batch size
        (ZEN4, "auto", "cpu", 1, True, "native"),  # the VNNI tiles: faster at every batch size
        (AMX_XEON, "auto", "cpu", 1, True, "native"),  # 3.2x at batch 1; lost at 64 and prefill
        (ZEN4, "auto", "cpu", 2, True, "dequantized"),  # tensor parallelism: not measured
        (ZEN3, "float32", "cpu", 1, True, "dequantized"),  # the path checked against HF
        (ZEN4, "auto", "cpu", 1, False, "dequantized"),  # a safetensors directory: no Q4_1 to serve
        (set(), "auto", "cuda", 1, True, "dequantized"),
    ],
)
def test_auto_weights_are_native_where_measured_to_win(
    monkeypatch, flags: set[str], dtype_flag: str, device: str, ranks: int, gguf: bool, expected: str
) -> None:
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    assert resolve_weights(RunnerConfig(dtype=dtype_flag), device, ranks, gguf) == expected


def test_auto_falls_back_to_dequantized_weights_where_the_model_has_no_q4_1_layers(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")  # a safetensors directory: nothing native to serve
    assert native_linears_or_none(str(tmp_path), SMOLLM2_SHAPE, required=False) is None


@pytest.mark.parametrize(
    ("weights", "device", "dtype", "message"),
    [
        ("native", "cuda", "auto", "runs on cpu with --dtype float32"),
        ("native", "cpu", "bfloat16", "runs on cpu with --dtype float32"),
        ("int8", "cpu", "auto", "must be auto, dequantized or native"),
    ],
)
def test_refused_combinations_say_why(weights: str, device: str, dtype: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_weights(RunnerConfig(weights=weights, dtype=dtype), device)


def test_native_refuses_a_model_that_is_not_a_gguf(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="needs a GGUF model"):
        native_linears_or_none(str(tmp_path), SMOLLM2_SHAPE, required=True)


@pytest.mark.parametrize(
    ("flags", "weights", "device", "expected"),
    [
        ({"avx2", "fma"}, "dequantized", "cpu", "float32"),  # bf16 GEMMs are emulated: fp32 is faster
        ({"avx512f", "avx512_bf16"}, "dequantized", "cpu", "bfloat16"),
        ({"amx_bf16"}, "dequantized", "cpu", "bfloat16"),
        ({"avx512_bf16"}, "native", "cpu", "float32"),  # the Q4_1 kernels keep fp32 around them
        (set(), "dequantized", "cuda", "bfloat16"),
        (set(), "dequantized", "cuda:1", "bfloat16"),
    ],
)
def test_auto_dtype_follows_the_weights_and_what_the_hardware_multiplies_natively(
    monkeypatch, flags: set[str], weights: str, device: str, expected: str
) -> None:
    """`weights` as `resolve_weights` chose them."""
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    assert resolve_dtype(RunnerConfig(), device, weights) == expected


def test_an_explicit_dtype_is_kept_and_a_wrong_one_refused() -> None:
    assert resolve_dtype(RunnerConfig(dtype="bfloat16"), "cpu", "dequantized") == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be auto, float32, bfloat16 or float16, got 'fp8'"):
        resolve_dtype(RunnerConfig(dtype="fp8"), "cpu", "dequantized")


def test_cpu_flags_come_from_proc_cpuinfo() -> None:
    flags = cpu_features.cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo here")
    assert "sse2" in flags or "fpu" in flags
