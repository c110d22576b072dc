"""Whole models at tensor-parallel sizes 2 and 3 against the same model unsharded (TP=1).

Rank 0 runs in this process (`start_local_group`: the code `kvserve executor -tp N` runs), ranks
1 … N−1 as real `python -m kvserve.executor` processes, with gloo collectives and the plan broadcast
between them. One workload drives both: chunked prefill, several decode steps, shared and copied
prefix blocks, a reset. Greedy tokens must be identical and every returned log-probability (the
sampled token's and the top 5) allclose, which the logits determine.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.process import start_local_group
from kvserve.executor.protocol import Executor
from kvserve.executor.runner_config import RunnerConfig
from kvserve.executor.tensor_parallel.config import TensorParallelConfig
from kvserve.protos.sampling import SamplingParams
from kvserve.testing.plan_driver import PlanDriver
from kvserve.testing.tiny_checkpoints import SHARDABLE, write_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)

TINY = {k: v for k, v in SHARDABLE.items() if k != "num_key_value_heads"}
GREEDY = SamplingParams(temperature=0.0, logprobs=5)

Trace = list[tuple[int, int, float, list[tuple[int, float]]]]


def _prompt(key: int, length: int) -> list[int]:
    return [(key * 31 + i * 17) % TINY["vocab_size"] for i in range(length)]


def _drive(executor: Executor) -> Trace:
    """Every sampled token of the workload with its log-probabilities, in order."""
    driver = PlanDriver(executor)
    first = driver.add(0, _prompt(0, 45), 6, sampling=GREEDY, chunk_size=16, retain=True)  # 3 prefill chunks
    driver.add(1, _prompt(1, 20), 8, sampling=GREEDY)
    driver.run()
    shared = first.block_table[:2]  # 32 tokens of seq 0's prompt, computed
    driver.add(2, first.token_ids[:32] + _prompt(2, 9), 5, sampling=GREEDY, prefix_blocks=shared)
    driver.add(3, first.token_ids[:32] + _prompt(3, 4), 5, sampling=GREEDY, prefix_blocks=shared, copy_prefix=True)
    driver.run()
    results = list(driver.last_results)
    executor.reset()  # a scheduler re-sync: every rank forgets its sequences
    again = PlanDriver(executor)
    again.add(4, _prompt(4, 30), 4, sampling=GREEDY, chunk_size=8)
    again.run()
    return [
        (out.seq_id, out.token_id, out.logprob or 0.0, [(t.token_id, t.logprob) for t in out.top_logprobs])
        for result in results + again.last_results
        for out in result.outputs
    ]


def _assert_same(got: Trace, want: Trace) -> None:
    assert [(seq, token) for seq, token, _, _ in got] == [(seq, token) for seq, token, _, _ in want]
    torch.testing.assert_close(torch.tensor([lp for _, _, lp, _ in got]), torch.tensor([lp for _, _, lp, _ in want]))
    for (_, _, _, top), (_, _, _, want_top) in zip(got, want, strict=True):
        assert [t for t, _ in top] == [t for t, _ in want_top]
        torch.testing.assert_close(torch.tensor([lp for _, lp in top]), torch.tensor([lp for _, lp in want_top]))


def _config(path) -> RunnerConfig:
    return RunnerConfig(model=str(path), device="cpu", dtype="float32", kv_cache_gb=0.01, max_model_len=256)


@pytest.mark.parametrize(
    "arch,kv_heads",
    [("llama", 6), ("mistral", 6), ("qwen2", 12), ("llama", 1)],
    ids=["llama", "mistral", "qwen2", "llama-one-kv-head-replicated"],
)
def test_tiny_models_at_two_and_three_ranks_match_one(tmp_path, arch, kv_heads) -> None:
    path = write_tiny_checkpoint(tmp_path / arch, arch, num_key_value_heads=kv_heads, **TINY)
    alone = ModelRunner(_config(path))
    want = _drive(alone)
    num_blocks = alone.info().num_blocks
    alone.close()
    for size in (2, 3):
        group = start_local_group(_config(path), TensorParallelConfig(tensor_parallel_size=size))
        try:
            # Each rank holds 1/size of the KV heads (or one replicated head): its pool of the same
            # budget is larger, and every rank plans with the smallest.
            pool = group.info().num_blocks
            assert pool > num_blocks if kv_heads >= size else pool == num_blocks  # one replicated head each
            _assert_same(_drive(group), want)
        finally:
            group.close()
        assert all(p.poll() is not None for p in group.ranks.processes.values()), "a rank outlived close()"


@pytest.mark.slow
def test_default_model_at_three_ranks_answers_the_france_prompt_as_one(default_model_dir) -> None:
    """SmolLM2-135M: 9 heads and 3 KV heads split 3 ways, the vocabulary of 49,152 in 3 rows of 16,384."""
    from kvserve.scheduler.server.intake.tokenizer import ChatMessage, Tokenizer

    tokenizer = Tokenizer.from_dir(default_model_dir)
    prompt = tokenizer.encode_chat([ChatMessage("user", "What is the capital of France?")])
    config = RunnerConfig(model=str(default_model_dir), device="cpu", dtype="float32", max_model_len=512)

    def answer(executor: Executor) -> list[int]:
        driver = PlanDriver(executor)
        driver.add(0, prompt, 12)
        return driver.run()[0]

    alone = ModelRunner(config)
    want = answer(alone)
    alone.close()
    group = start_local_group(config, TensorParallelConfig(tensor_parallel_size=3))
    try:
        got = answer(group)
    finally:
        group.close()
    assert "Paris" in tokenizer.decode(want)
    assert got == want


@pytest.mark.cuda
@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (nccl between two ranks)")
def test_two_gpus_with_nccl_match_one(tmp_path) -> None:
    """The same workload on `cuda:0` + `cuda:1` over nccl against one GPU, in float32."""
    path = write_tiny_checkpoint(tmp_path / "llama", "llama", num_key_value_heads=6, **TINY)
    config = RunnerConfig(model=str(path), device="cuda", dtype="float32", kv_cache_gb=0.01, max_model_len=256)
    alone = ModelRunner(config)
    want = _drive(alone)
    alone.close()
    group = start_local_group(config, TensorParallelConfig(tensor_parallel_size=2))
    try:
        assert group.runner.info().device == "cuda:0"
        _assert_same(_drive(group), want)
    finally:
        group.close()
