"""CUDA graphs of the decode step (`--compile on` on CUDA): a bucket's static inputs serve any step
that fits it, and give eager's tokens.

Without a GPU the same static-input path runs with no graph (`capture=False`) through the Triton
kernels under `TRITON_INTERPRET=1`: padding, the copies into the bucket's tensors, the launch sized
for the block tables' full width. With one (`-m cuda`, scripts/gpu_check.sh) the graphs are captured
and replayed by the runner `--compile on` builds.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvserve.executor.config_error import ExecutorConfigError
from kvserve.executor.model.cuda_graphs import CudaDecodeGraphs, is_pure_decode
from kvserve.executor.model.decode_graphs import PAD_SLOT
from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.runner_config import RunnerConfig, resolve_compile
from kvserve.testing.plan_driver import run_prompts
from kvserve.testing.tiny_checkpoints import PROMPTS, tiny_checkpoint

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BUCKETS = (1, 2, 4)
MAX_MODEL_LEN = 64
"""Past the longest prompt and its tokens (52); a graph's launch is sized for it, so the interpreter's is small."""


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")[1]


def runner(model: Any, device: str, **config: Any) -> ModelRunner:
    return ModelRunner(
        RunnerConfig(
            model=str(model),
            device=device,
            dtype="float32",
            kv_cache_gb=0.001,
            attention_backend="triton",
            max_model_len=MAX_MODEL_LEN,
            **config,
        )
    )


def with_static_buckets(runner: ModelRunner, buckets: tuple[int, ...]) -> CudaDecodeGraphs:
    """The runner's decode steps through `buckets`' static inputs, without capturing a graph."""
    width = -(-runner.max_model_len // runner.config.block_size)
    graphs = CudaDecodeGraphs(runner.model, runner.cache, runner.backend, buckets, width, capture=False)
    assert [c.batch for c in graphs.capture_all()] == list(buckets)
    runner.graphs = graphs
    return graphs


@pytest.fixture(scope="module")
def eager_tokens(tiny_llama):
    """Greedy tokens of the four prompts together, and of the first three together."""
    eager = runner(tiny_llama, "cpu")
    return run_prompts(eager, PROMPTS), run_prompts(eager, PROMPTS[:3])


def test_a_full_and_a_padded_bucket_give_eager_tokens(tiny_llama, eager_tokens):
    """Four sequences decode in bucket 4 as it is; three in bucket 4 beside a padding row."""
    served = runner(tiny_llama, "cpu")
    graphs = with_static_buckets(served, BUCKETS)
    assert run_prompts(served, PROMPTS) == eager_tokens[0]
    full = graphs.replays
    assert full > 0
    assert run_prompts(served, PROMPTS[:3]) == eager_tokens[1]
    assert graphs.replays > full


def test_a_step_past_the_largest_bucket_runs_eagerly(tiny_llama, eager_tokens):
    served = runner(tiny_llama, "cpu")
    graphs = with_static_buckets(served, (1, 2))  # four sequences decode in one step: no bucket holds them
    assert run_prompts(served, PROMPTS) == eager_tokens[0]
    assert graphs.replays == 0


def test_alone_each_sequence_takes_bucket_1(tiny_llama):
    eager, served = runner(tiny_llama, "cpu"), runner(tiny_llama, "cpu")
    graphs = with_static_buckets(served, BUCKETS)
    for prompt in PROMPTS:
        before = graphs.replays
        assert run_prompts(served, [prompt]) == run_prompts(eager, [prompt])
        assert graphs.replays > before


def test_a_smaller_step_resets_the_rows_a_larger_one_filled(tiny_llama):
    served = runner(tiny_llama, "cpu")
    graphs = with_static_buckets(served, (4,))
    run_prompts(served, PROMPTS[:3])
    static = graphs._static[4].batch
    first = static.attention.slot_mapping.tolist()
    run_prompts(served, PROMPTS[:1])
    meta = static.attention
    assert first[:3] != [PAD_SLOT] * 3 and first[3] == PAD_SLOT
    assert meta.slot_mapping.tolist()[1:] == [PAD_SLOT] * 3
    assert meta.seq_lens.tolist()[1:] == [1, 1, 1] and static.input_ids.tolist()[1:] == [0, 0, 0]
    assert static.positions.tolist()[1:] == [0, 0, 0] and meta.block_tables[1:, 0].tolist() == [0, 0, 0]


def test_only_pure_decode_steps_are_served() -> None:
    from tests.executor.test_decode_graphs import decode_batch, verification_batch

    assert is_pure_decode(decode_batch(3, 2))
    assert not is_pure_decode(verification_batch())  # several rows a sequence: the extend kernel
    prefill = decode_batch(3, 2)
    prefill.sample_indices = prefill.sample_indices[1:]
    assert not is_pure_decode(prefill)


def test_compile_on_cuda_needs_triton_and_one_rank() -> None:
    config = RunnerConfig(compile="on")
    assert resolve_compile(config, "cuda:0", "dequantized", "triton", 1) is True
    assert resolve_compile(RunnerConfig(), "cuda:0", "dequantized", "triton", 1) is False  # auto: not measured yet
    with pytest.raises(ExecutorConfigError, match="need --attention-backend triton and one rank"):
        resolve_compile(config, "cuda", "dequantized", "torch", 1)
    with pytest.raises(ExecutorConfigError, match="need --attention-backend triton and one rank"):
        resolve_compile(config, "cuda", "dequantized", "triton", 2)


def test_graphs_refuse_another_attention_backend(tiny_llama) -> None:
    served = ModelRunner(RunnerConfig(model=str(tiny_llama), dtype="float32", kv_cache_gb=0.001))
    with pytest.raises(ValueError, match="need the triton attention backend"):
        CudaDecodeGraphs(served.model, served.cache, served.backend, BUCKETS, 4)


@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA)])
def test_captured_graphs_give_eager_tokens_on_cuda(tiny_llama, _) -> None:
    """The runner `--compile on` builds on CUDA: the buckets `max_num_seqs` can reach, captured; full,
    padded and alone; and a bucket miss."""
    eager_runner = runner(tiny_llama, "cuda")
    eager = [run_prompts(eager_runner, prompts) for prompts in (PROMPTS, PROMPTS[:3], PROMPTS[:1])]
    served = runner(tiny_llama, "cuda", compile="on", compile_buckets="1,2,4,8", max_num_seqs=4)
    assert isinstance(served.graphs, CudaDecodeGraphs)
    assert sorted(served.graphs._static) == [1, 2, 4]  # no step of 4 sequences at most takes bucket 8
    assert all(b.graph is not None for b in served.graphs._static.values())
    for prompts, expected in zip((PROMPTS, PROMPTS[:3], PROMPTS[:1]), eager):
        before = served.graphs.replays
        assert run_prompts(served, prompts) == expected
        assert served.graphs.replays > before
    missed = runner(tiny_llama, "cuda", compile="on", compile_buckets="1,2")
    assert run_prompts(missed, PROMPTS) == eager[0]
    assert isinstance(missed.graphs, CudaDecodeGraphs) and missed.graphs.replays == 0
