"""The sizes every check runs at: the H200 run, and a toy CPU rehearsal of the same code.

All the knobs of the time budget live here. The GPU sizes keep the whole run under eight
minutes (request counts and steps are small; the 8B model is built once and shared). The
rehearsal runs the same checks on CPU at toy sizes, so the code paths are exercised before
a GPU is lent (`python -m kvserve.gpu_check OUT --cpu-rehearsal`).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True, slots=True)
class Scale:
    name: str
    device: str
    big_model: str
    """Key of kvserve/gpu_check/model_shapes.json: the model the measurements and serve checks use."""
    small_model: str
    # runner_vs_hf_8b_logits
    logits_prompt_len: int
    logits_decode_steps: int
    # device_peaks
    copy_bytes: int
    gemm_size: int
    # decode_attention_bandwidth (the big model's attention shape)
    attention_contexts: tuple[int, ...]
    attention_batches: tuple[int, ...]
    attention_min_pool_bytes: int
    """Each timed call reads blocks no other call of the loop reads, from a pool at least this big
    (well past the L2 cache), so small cases are not served from cache."""
    # kv_sizing, decode_throughput, prefill_throughput (one runner)
    max_num_batched_tokens: int
    decode_batches: tuple[int, ...]
    decode_prompt_len: int
    decode_steps: int
    prefill_shapes: tuple[tuple[int, int], ...]
    """(sequences, prompt tokens) of each prefill step timed."""
    # serve checks
    serve_streams: int
    serve_tokens: int
    bench_requests: int
    bench_concurrency: int
    bench_max_tokens: int
    hf_batch_size: int
    startup_timeout_s: float
    limit_factor: float = 1.0
    """Every check's time limit is multiplied by this (CPU steps are slower than the GPU's)."""


GPU = Scale(
    name="gpu",
    device="cuda",
    big_model="llama-3.1-8b-shaped",
    small_model="smollm2-135m",
    logits_prompt_len=96,
    logits_decode_steps=32,
    copy_bytes=4 * GIB,
    gemm_size=8192,
    attention_contexts=(1024, 8192),
    attention_batches=(1, 64, 256),
    attention_min_pool_bytes=1 * GIB,
    # the largest decode batch's prefill in one step: 256 x 512 tokens (the profile reserves it)
    max_num_batched_tokens=256 * 512,
    decode_batches=(1, 8, 64, 256),
    decode_prompt_len=512,
    decode_steps=8,
    prefill_shapes=((1, 2048), (16, 2048)),
    serve_streams=64,
    serve_tokens=96,
    bench_requests=32,
    bench_concurrency=32,
    bench_max_tokens=64,
    hf_batch_size=8,
    startup_timeout_s=240.0,
)

CPU_REHEARSAL = Scale(
    name="cpu-rehearsal",
    device="cpu",
    big_model="toy-8b-shaped",
    small_model="toy-smollm2",
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
    prefill_shapes=((1, 64),),
    serve_streams=8,
    serve_tokens=12,
    bench_requests=4,
    bench_concurrency=4,
    bench_max_tokens=8,
    hf_batch_size=2,
    startup_timeout_s=180.0,
    limit_factor=5.0,
)


def scale_for(mode: str) -> Scale:
    return CPU_REHEARSAL if mode == "cpu-rehearsal" else GPU
