"""`--weights native` on the default model: the GGUF's Q4_1 layers, served 4-bit.

The codes, q/k rows un-permuted, dequantize exactly to the converted directory's fp32
weights; the Q4_1 kernel computes with them against 8-bit activations; the lm_head runs Q8_0
on the GGUF's own codes; and the native path's greedy output does not depend on how a
sequence is batched, chunked or prefix-shared.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.runner_config import RunnerConfig
from kvserve.executor.weights import model_store
from kvserve.executor.weights.gguf_q4_1 import dequantize
from kvserve.executor.weights.gguf_weights import read_q4_1_layers
from kvserve.executor.weights.q4_1_linear import Q4_1Linear
from kvserve.executor.weights.q8_0 import Q8Linear, unpack
from kvserve.executor.weights.row_invariance import RowFixedLinear
from kvserve.kernels import cpu_ops
from kvserve.kernels.reference import q8_activations_reference
from kvserve.scheduler.server.intake.tokenizer import Tokenizer
from kvserve.testing.plan_driver import PlanDriver

pytestmark = pytest.mark.slow

HF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea and the wind, in the style of a children's song:",
    "Question: What is the boiling point of water at sea level in degrees Celsius?\nAnswer:",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "List three benefits of regular exercise for office workers:\n1.",
    "def fibonacci(n):\n    ",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    runner = ModelRunner(RunnerConfig(weights="native", kv_cache_gb=0.25))
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def prompt_ids(default_model_dir) -> list[list[int]]:
    tokenizer = Tokenizer.from_dir(default_model_dir)
    return [tokenizer.encode(p) for p in PROMPTS]


def test_gguf_codes_dequantize_to_the_converted_fp32_weights(default_model_dir, runner) -> None:
    source = model_store.default_model_source()
    layers = read_q4_1_layers(source.path / source.gguf_file, runner.model_config)
    with safe_open(str(default_model_dir / "model.safetensors"), framework="pt") as converted:
        for i, layer in enumerate(layers):
            for gguf_name, hf_name in HF_NAMES.items():
                expected = converted.get_tensor(f"model.layers.{i}.{hf_name}.weight").float()
                assert torch.equal(dequantize(layer[gguf_name]), expected), (i, gguf_name)


def test_every_layer_runs_4_bit_on_the_codes_it_shipped_with(runner) -> None:
    layer = runner.model.weights.layers[0]
    linears = [getattr(layer, n) for n in ("qkv", "o_proj", "gate_up", "down")]
    # each in fixed GEMM call shapes (kvserve.executor.weights.row_invariance)
    assert all(isinstance(lin, RowFixedLinear) and isinstance(lin.inner, Q4_1Linear) for lin in linears)
    assert all(lin.min_rows == 1 for lin in linears)  # its own kernel sums every row alike: never padded
    assert runner.model.native_layers is not None  # each layer one fused op (kvserve.executor.model.native_layers)
    # The threads go to the kernels' loops, and torch keeps one (kernels/cpu/work_pool.h says why).
    assert runner.info().num_threads == cpu_ops.num_threads() == runner.num_threads >= 1
    assert torch.get_num_threads() == 1
    # K/V stored in bfloat16 under fp32 activations (runner_config.resolve_kv_cache_dtype says why)
    assert runner.kv_dtype_name == "bfloat16" and runner.cache.tensor.dtype == torch.bfloat16
    assert runner.info().model_id.endswith("+q4_1")  # never shares a prefix cache with the fp32 weights
    source = model_store.default_model_source()
    q4 = read_q4_1_layers(source.path / source.gguf_file, runner.model_config)[0]
    x = torch.randn(40, q4["attn_output"].shape[1])
    qx, dx = q8_activations_reference(x)  # the kernel's 8-bit activations
    x_q8 = (qx.double() * dx.double()[..., None]).reshape(x.shape)
    expected = (x_q8 @ dequantize(q4["attn_output"]).double().t()).float()
    torch.testing.assert_close(layer.o_proj(x), expected, rtol=1e-5, atol=1e-5)


def test_the_lm_head_runs_q8_0_on_the_codes_the_gguf_shipped_with(runner) -> None:
    """The head is quantized from the converted fp32 embedding; Q8_0's rule gives back the file's own
    codes and scales, every one, so the head computes with the weights llama.cpp computes with."""
    import numpy as np
    from gguf import GGUFReader

    head = runner.model.weights.lm_head
    assert isinstance(head, RowFixedLinear) and isinstance(head.inner, Q8Linear)
    assert head.min_rows == 1  # its own kernel sums every row alike: a decode row is never padded
    source = model_store.default_model_source()
    (embedding,) = [t for t in GGUFReader(str(source.path / source.gguf_file)).tensors if t.name == "token_embd.weight"]
    assert embedding.tensor_type.name == "Q8_0"
    blocks = np.ascontiguousarray(np.asarray(embedding.data)).reshape(embedding.data.shape[0], -1, 34)
    codes, d = unpack(head.inner)
    assert torch.equal(codes, torch.from_numpy(blocks[:, :, 2:].copy().view(np.int8)).reshape(codes.shape))
    assert torch.equal(d, torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[..., 0]).float())


def _greedy(runner, prompt_ids, **add) -> dict[int, list[int]]:
    driver = PlanDriver(runner)
    for i, ids in enumerate(prompt_ids):
        driver.add(i, ids, NEW_TOKENS, **add)
    return driver.run()


def test_native_greedy_output_does_not_depend_on_batching(runner, prompt_ids) -> None:
    alone: dict[int, list[int]] = {}
    for i, ids in enumerate(prompt_ids):
        driver = PlanDriver(runner)
        driver.add(i, ids, NEW_TOKENS)
        alone.update(driver.run())
    assert "Paris" in Tokenizer.from_dir(runner.model_dir).decode(alone[0])
    # In a batch of 16 (ten more prompts beside them), and prefilled in chunks of 5.
    fillers = [f"Tell me a fact about the number {k}." for k in range(10)]
    tokenizer = Tokenizer.from_dir(runner.model_dir)
    batched = _greedy(runner, prompt_ids + [tokenizer.encode(f) for f in fillers])
    assert {i: batched[i] for i in alone} == alone
    assert _greedy(runner, prompt_ids, chunk_size=5) == alone
