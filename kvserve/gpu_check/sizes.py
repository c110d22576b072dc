"""The sizes every check runs at: the H200 run's (the defaults) beside a toy CPU rehearsal's of the same code."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace


def rehearsal(value: object) -> dict[str, object]:  # a size's value in the CPU rehearsal, beside the GPU run's
    return {"rehearsal": value}


@dataclass(frozen=True, slots=True)
class Sizes:
    name: str = field(default="gpu", metadata=rehearsal("cpu-rehearsal"))
    device: str = field(default="cuda", metadata=rehearsal("cpu"))
    budget_s: float = field(default=460.0, metadata=rehearsal(1500.0))  # the run: twice in 15 min of device time
    budget_factor: float = field(default=1.0, metadata=rehearsal(5.0))  # times every stage's budget
    big_model: str = field(default="llama-3.1-8b-shaped", metadata=rehearsal("toy-8b-shaped"))  # model_shapes.json
    logits_prompt_len: int = field(default=96, metadata=rehearsal(24))
    logits_decode_steps: int = field(default=32, metadata=rehearsal(4))
    copy_bytes: int = field(default=4 * 2**30, metadata=rehearsal(64 * 2**20))
    gemm_size: int = field(default=8192, metadata=rehearsal(256))
    attention_contexts: tuple[int, ...] = field(default=(1024, 8192), metadata=rehearsal((64, 160)))
    attention_batches: tuple[int, ...] = field(default=(1, 64, 256), metadata=rehearsal((1, 3)))
    attention_min_pool_bytes: int = field(default=2**30, metadata=rehearsal(2**20))  # past the L2 cache
    max_num_batched_tokens: int = field(default=256 * 512, metadata=rehearsal(4 * 32))  # the largest batch's prefill
    decode_batches: tuple[int, ...] = field(default=(1, 8, 64, 256), metadata=rehearsal((1, 4)))
    decode_prompt_len: int = field(default=512, metadata=rehearsal(32))
    decode_steps: int = field(default=8, metadata=rehearsal(2))
    graph_batches: tuple[int, ...] = field(default=(1, 64), metadata=rehearsal((1, 4)))  # CUDA-graph buckets
    prefill_shapes: tuple[tuple[int, int], ...] = field(default=((1, 2048), (16, 2048)), metadata=rehearsal(((1, 64),)))
    serve_streams: int = field(default=64, metadata=rehearsal(8))
    serve_tokens: int = field(default=96, metadata=rehearsal(12))
    bench_requests: int = field(default=32, metadata=rehearsal(4))
    bench_concurrency: int = field(default=32, metadata=rehearsal(4))
    bench_max_tokens: int = field(default=64, metadata=rehearsal(8))
    hf_batch_size: int = field(default=8, metadata=rehearsal(2))
    startup_timeout_s: float = field(default=240.0, metadata=rehearsal(180.0))


GPU = Sizes()
CPU_REHEARSAL = replace(GPU, **{f.name: f.metadata["rehearsal"] for f in fields(Sizes)})
SIZES = {s.name: s for s in (GPU, CPU_REHEARSAL)}
