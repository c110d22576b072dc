"""`--weights native` refuses what it cannot serve, by name, and `kvserve serve` says so without a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGUFWriter

from kvserve.executor.config_error import ExecutorConfigError
from kvserve.executor.weights.gguf_q4_1 import BLOCK_BYTES, parse_q4_1
from kvserve.executor.weights.gguf_weights import NativeWeightsUnavailable, native_layer_linears, read_q4_1_layers
from kvserve.testing.tiny_checkpoints import tiny_checkpoint


def _gguf_with_f32_layers(path: Path) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_whose_layers_are_not_q4_1_is_refused_by_tensor(tmp_path: Path) -> None:
    config = SimpleNamespace(num_layers=1, num_heads=4, num_kv_heads=4)
    with pytest.raises(NativeWeightsUnavailable, match=r"blk\.0\.attn_q\.weight is F32, not Q4_1"):
        read_q4_1_layers(_gguf_with_f32_layers(tmp_path / "f32.gguf"), config)  # type: ignore[arg-type]


def test_qkv_biases_are_refused_before_anything_is_read(tmp_path: Path) -> None:
    config = SimpleNamespace(attention_bias=True)
    with pytest.raises(NativeWeightsUnavailable, match="q/k/v biases are not read from GGUF files"):
        native_layer_linears(tmp_path / "absent.gguf", config)  # type: ignore[arg-type]


def test_a_q4_1_row_of_partial_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match=f"whole {BLOCK_BYTES}-byte blocks, got {BLOCK_BYTES + 1} bytes"):
        parse_q4_1(np.zeros((2, BLOCK_BYTES + 1), dtype=np.uint8))


def test_refusals_are_configuration_errors() -> None:
    # What `kvserve executor` turns into exit code 2 and one line, not a traceback.
    assert issubclass(NativeWeightsUnavailable, ExecutorConfigError)


def _serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvserve", "serve", "--port", "0", "--http-port", "0", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )


@pytest.mark.parametrize(
    ("model", "executor_flags", "message"),
    [
        ("hf", ["--weights", "native"], "--weights native needs a GGUF model; "),
        (None, ["--weights", "native", "--dtype", "bfloat16"], "--weights native runs on cpu with --dtype float32"),
        ("missing", ["--weights", "native"], "is neither 'smollm2-135m-instruct', a directory with config.json, nor"),
    ],
)
def test_kvserve_serve_reports_a_native_refusal_and_exits_2(
    tmp_path: Path, model: str | None, executor_flags: list[str], message: str
) -> None:
    args = list(executor_flags)
    if model == "hf":
        args += ["--model", str(tiny_checkpoint(tmp_path, "llama")[1])]
    elif model == "missing":
        args += ["--model", str(tmp_path / "no-such-model")]
    result = _serve(tmp_path, *args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert message in result.stderr
    assert "the executor refused its configuration" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
