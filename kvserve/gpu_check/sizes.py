"""The sizes every check runs at: the H200 run (the defaults) and a toy CPU rehearsal of the same code."""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 2**30


@dataclass(frozen=True, slots=True)
class Sizes:
    name: str = "gpu"
    device: str = "cuda"
    budget_s: float = 460.0
    """The whole run: it must fit twice into 15 minutes of device time."""
    budget_factor: float = 1.0
    """Every stage's budget is multiplied by this (CPU steps are slower than the GPU's)."""
    big_model: str = "llama-3.1-8b-shaped"
    """The key in model_shapes.json of the model the measurements and serve checks use."""
    logits_prompt_len: int = 96
    logits_decode_steps: int = 32
    copy_bytes: int = 4 * GIB
    gemm_size: int = 8192
    attention_contexts: tuple[int, ...] = (1024, 8192)
    attention_batches: tuple[int, ...] = (1, 64, 256)
    attention_min_pool_bytes: int = GIB
    """The timed calls cycle through disjoint blocks of a pool this big (past the L2 cache)."""
    max_num_batched_tokens: int = 256 * 512
    """The largest decode batch's prefill in one step (the runner's profile reserves it)."""
    decode_batches: tuple[int, ...] = (1, 8, 64, 256)
    decode_prompt_len: int = 512
    decode_steps: int = 8
    graph_batches: tuple[int, ...] = (1, 64)
    """The CUDA-graph buckets captured and timed against eager decode."""
    prefill_shapes: tuple[tuple[int, int], ...] = ((1, 2048), (16, 2048))
    """(sequences, prompt tokens) of each prefill step timed."""
    serve_streams: int = 64
    serve_tokens: int = 96
    bench_requests: int = 32
    bench_concurrency: int = 32
    bench_max_tokens: int = 64
    hf_batch_size: int = 8
    startup_timeout_s: float = 240.0


GPU = Sizes()
CPU_REHEARSAL = replace(
    GPU,
    name="cpu-rehearsal",
    device="cpu",
    budget_s=1500.0,
    budget_factor=5.0,
    big_model="toy-8b-shaped",
    logits_prompt_len=24,
    logits_decode_steps=4,
    copy_bytes=64 * 2**20,
    gemm_size=256,
    attention_contexts=(64, 160),
    attention_batches=(1, 3),
    attention_min_pool_bytes=2**20,
    max_num_batched_tokens=4 * 32,
    decode_batches=(1, 4),
    decode_prompt_len=32,
    decode_steps=2,
    graph_batches=(1, 4),
    prefill_shapes=((1, 64),),
    serve_streams=8,
    serve_tokens=12,
    bench_requests=4,
    bench_concurrency=4,
    bench_max_tokens=8,
    hf_batch_size=2,
    startup_timeout_s=180.0,
)


def sizes_for(mode: str) -> Sizes:
    return CPU_REHEARSAL if mode == "cpu-rehearsal" else GPU
