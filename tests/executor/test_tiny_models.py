"""Loading tiny random Llama / Mistral / Qwen2 checkpoints and matching transformers' logits.

The checkpoints are written with `save_pretrained` into a tmp dir (no real weights, fast).
Logits are compared for every prompt position, over a two-step run (prefill, then an
extend over the cached context) so the paged cache is exercised too. The same comparisons
run on CUDA under `pytest -m cuda` (scripts/gpu_check.sh), against transformers on CPU.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from kvserve.executor.model_config import UnsupportedModelError
from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.runner_config import RunnerConfig
from kvserve.executor.token_scoring import every_position_logits
from kvserve.protos.sampling import SamplingParams
from kvserve.testing.plan_driver import PlanDriver, run_prompts
from kvserve.testing.tiny_checkpoints import CASES, PROMPTS, tiny_checkpoint

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
IEEE_F32 = pytest.mark.skipif(
    os.environ.get("TRITON_F32_DEFAULT") != "ieee",
    reason="Triton's float32 dots are TF32 on CUDA unless TRITON_F32_DEFAULT=ieee (scripts/gpu_check.sh sets it)",
)
CUDA_BACKENDS = [pytest.param("torch", marks=CUDA), pytest.param("triton", marks=[*CUDA, IEEE_F32])]
DEVICE_BACKENDS = [
    *[pytest.param("cpu", b, id=b) for b in ("cpu", "torch", "triton")],
    pytest.param("cuda", "torch", id="cuda-torch", marks=CUDA),
    pytest.param("cuda", "triton", id="cuda-triton", marks=[*CUDA, IEEE_F32]),
]
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
)  # fmt: skip
"""SmolLM2-135M's shape (the default model's config.json): 9 heads over 3 of width 64, 30 layers, 49152 tokens."""


@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case, device, backend):
    info = _check_logits(tmp_path, *CASES[case], backend, device)
    assert info.vocab_size == 256 and info.max_model_len == 256


@pytest.mark.parametrize("block_size", [8, 64])
def test_triton_logits_match_transformers_at_other_block_sizes(tmp_path, block_size):
    """The extend kernel through the whole runner; 8-token blocks take its two-blocks-per-tile path."""
    _check_logits(tmp_path, *CASES["llama-linear-rope"], "triton", block_size=block_size)


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_a_real_model_shape_matches_transformers_on_cuda(tmp_path, backend):
    info = _check_logits(tmp_path, "llama", SMOLLM2_135M, backend, "cuda", kv_cache_gb=0.01)
    assert info.vocab_size == SMOLLM2_135M["vocab_size"]


def _check_logits(
    tmp_path, arch: str, overrides: dict, backend: str, device: str = "cpu", block_size: int = 16, kv_cache_gb=0.001
) -> Any:
    model, path = tiny_checkpoint(tmp_path, arch, **overrides)
    config = RunnerConfig(
        model=str(path),
        device=device,
        dtype="float32",
        kv_cache_gb=kv_cache_gb,
        attention_backend=backend,
        block_size=block_size,
    )
    runner = ModelRunner(config)
    tokens = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expected = model(torch.tensor([tokens])).logits[0]
    got = every_position_logits(runner, tokens, split=20).cpu()
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    info = runner.info()
    assert info.attention_backend == backend and info.block_size == block_size
    assert info.model_id.startswith(f"{arch}@")
    return info


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelRunner(RunnerConfig(model=str(tmp_path)))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")[1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[*CUDA, IEEE_F32])])
def test_triton_backend_generates_the_same_tokens_as_torch(tiny_llama, device):
    """Chunked prefills, then decode steps (the paged decode kernel) with sampled tokens fed back."""
    by_backend = [
        run_prompts(
            ModelRunner(
                RunnerConfig(
                    model=str(tiny_llama), device=device, dtype="float32", kv_cache_gb=0.001, attention_backend=backend
                )
            ),
            PROMPTS,
            chunk_size=9,
        )
        for backend in ("torch", "triton")
    ]
    assert by_backend[0] == by_backend[1]


BLOCK_PROMPTS = [*PROMPTS, [(3 * j + 1) % 256 for j in range(77)]]
"""With 12 new tokens the longest context (89) crosses a 64-token block boundary."""


@pytest.fixture(scope="module")
def greedy_at_block_size_16(tiny_llama):
    runner = ModelRunner(RunnerConfig(model=str(tiny_llama), dtype="float32", kv_cache_gb=0.001))
    assert runner.info().block_size == 16
    assert runner.info().num_threads == torch.get_num_threads() >= 1  # the executor's ready line shows it
    return run_prompts(runner, BLOCK_PROMPTS, chunk_size=9)


@pytest.mark.parametrize("block_size", [8, 64])
def test_block_size_leaves_greedy_tokens_unchanged(tiny_llama, greedy_at_block_size_16, block_size):
    runner = ModelRunner(RunnerConfig(model=str(tiny_llama), dtype="float32", kv_cache_gb=0.001, block_size=block_size))
    assert runner.info().block_size == block_size == runner.cache.geometry.block_size
    assert run_prompts(runner, BLOCK_PROMPTS, chunk_size=9) == greedy_at_block_size_16


def test_runner_refuses_an_untested_block_size():
    with pytest.raises(ValueError, match=r"--block-size must be one of 8, 16, 32, 64, got 12"):
        RunnerConfig(block_size=12)


def test_swap_out_and_in_preserves_the_sequence(tiny_llama):
    runner = ModelRunner(RunnerConfig(model=str(tiny_llama), dtype="float32", kv_cache_gb=0.001, swap_space_gb=0.001))
    assert runner.info().num_cpu_blocks > 4
    expected = run_prompts(runner, PROMPTS[2:3])[0]

    from kvserve.protos.step import KnownSequence, NewSequence, StepPlan

    prompt = PROMPTS[2]
    greedy = SamplingParams(temperature=0.0)
    first = runner.execute(
        StepPlan(1, new_seqs=[NewSequence(5, prompt, len(prompt), 0, len(prompt), [3, 4], greedy, 0)])
    )
    tokens = prompt + [first.outputs[0].token_id]
    # Preempt by swap: blocks 3, 4 go to CPU blocks 0, 1 and are overwritten by another sequence.
    runner.execute(StepPlan(2, swap_out=[(3, 0), (4, 1)], drop_seq_ids=[5]))
    runner.execute(StepPlan(3, new_seqs=[NewSequence(6, PROMPTS[3], 40, 0, 40, [3, 4, 5], greedy, 0)], drop_seq_ids=[]))
    runner.execute(StepPlan(4, drop_seq_ids=[6]))
    # Resume into different device blocks.
    step = runner.execute(
        StepPlan(
            5,
            swap_in=[(0, 7), (1, 8)],
            new_seqs=[NewSequence(5, tokens, len(prompt), len(prompt), 1, [7, 8], greedy, 0)],
        )
    )
    outputs = [first.outputs[0].token_id, step.outputs[0].token_id]
    for i in range(10):
        tokens.append(outputs[-1])
        new_blocks = [9] if len(tokens) == 33 else []
        step = runner.execute(
            StepPlan(6 + i, known_seqs=[KnownSequence(5, [outputs[-1]], len(tokens) - 1, 1, new_blocks)])
        )
        outputs.append(step.outputs[0].token_id)
    assert outputs == expected


def test_copied_blocks_serve_as_prefix_and_reset_forgets_sequences(tiny_llama):
    runner = ModelRunner(RunnerConfig(model=str(tiny_llama), dtype="float32", kv_cache_gb=0.001))
    expected = run_prompts(runner, PROMPTS[3:4])[0]
    driver = PlanDriver(runner)
    driver.add(50, PROMPTS[3][:32] + [1, 2, 3], max_new_tokens=1, retain=True)
    driver.run()
    driver.add(0, PROMPTS[3], max_new_tokens=12, prefix_blocks=driver.retained[50][:2], copy_prefix=True)
    assert driver.run()[0] == expected
    from kvserve.executor.sequence_state import UnknownSequenceError
    from kvserve.protos.step import KnownSequence, StepPlan

    runner.reset()
    with pytest.raises(UnknownSequenceError):
        runner.execute(StepPlan(99, known_seqs=[KnownSequence(0, [1], 40, 1)]))


def test_a_bf16_kv_cache_holds_twice_the_tokens_and_stays_close_to_fp32(tmp_path):
    """--kv-cache-dtype bfloat16 under fp32 activations: K/V are stored rounded and widened on read,
    in prefill, extend and decode, so logits move by about bf16's rounding of K and V, no more."""
    _, path = tiny_checkpoint(tmp_path, "llama")
    fp32 = ModelRunner(RunnerConfig(model=str(path), dtype="float32", kv_cache_gb=0.001))
    bf16 = ModelRunner(RunnerConfig(model=str(path), dtype="float32", kv_cache_dtype="bfloat16", kv_cache_gb=0.001))
    assert bf16.cache.tensor.dtype == torch.bfloat16 and bf16.dtype == torch.float32
    assert bf16.info().num_blocks == 2 * fp32.info().num_blocks
    tokens = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    expected, got = every_position_logits(fp32, tokens, split=20), every_position_logits(bf16, tokens, split=20)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.02)
    assert not torch.equal(got, expected)  # the narrower cache really is in use
    decoded = run_prompts(bf16, PROMPTS)  # decode steps over a bf16 cache run and finish
    assert all(len(tokens) == 12 for tokens in decoded.values())


def test_a_kv_cache_dtype_other_than_the_activations_needs_a_cpu_or_torch_backend():
    from kvserve.executor.runner_config import resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype(RunnerConfig(), "bfloat16", "triton", "dequantized") == "bfloat16"
    bf16 = RunnerConfig(kv_cache_dtype="bfloat16")
    assert resolve_kv_cache_dtype(bf16, "float32", "torch", "dequantized") == "bfloat16"
    assert resolve_kv_cache_dtype(bf16, "float32", "cpu", "dequantized") == "bfloat16"
    with pytest.raises(ValueError, match="needs --attention-backend cpu or torch, not triton"):
        resolve_kv_cache_dtype(RunnerConfig(kv_cache_dtype="float16"), "bfloat16", "triton", "dequantized")
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, float32, bfloat16 or float16, got 'fp8'"):
        resolve_kv_cache_dtype(RunnerConfig(kv_cache_dtype="fp8"), "float32", "torch", "dequantized")


def test_auto_stores_kv_in_bfloat16_under_native_weights_and_in_the_activation_dtype_elsewhere():
    from kvserve.executor.runner_config import resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype(RunnerConfig(), "float32", "cpu", "native") == "bfloat16"
    assert resolve_kv_cache_dtype(RunnerConfig(), "float32", "cpu", "dequantized") == "float32"
    assert resolve_kv_cache_dtype(RunnerConfig(kv_cache_dtype="float32"), "float32", "cpu", "native") == "float32"
    assert resolve_kv_cache_dtype(RunnerConfig(kv_cache_dtype="float16"), "float32", "cpu", "native") == "float16"
