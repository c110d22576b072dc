"""`--compile on` at start-up: the decode forward captured once per batch-size bucket.

On CUDA the buckets `--max-num-seqs` can reach become CUDA graphs (`model.cuda_graphs`); on the CPU
each bucket is compiled by `torch.compile` (`model.decode_graphs`), with inductor's caches under
`--compile-cache-dir` (default `$KVSERVE_CACHE/inductor`), so only a machine's first start pays for
it. Apart from `model_runner.ModelRunner` because choosing, capturing and logging the graphs is one
start-up task of its own; the runner only asks for them and runs a step through them.
"""

from __future__ import annotations

import time
from pathlib import Path

import structlog
import torch

from kvserve.executor.attention.base import AttentionBackend
from kvserve.executor.disk_cache import cache_dir
from kvserve.executor.model.cuda_graphs import CudaDecodeGraphs
from kvserve.executor.model.decode_graphs import DecodeGraphs, buckets_up_to
from kvserve.executor.model.kv_cache import PagedKVCache
from kvserve.executor.model.llama import LlamaModel
from kvserve.executor.runner_config import RunnerConfig

log = structlog.get_logger(__name__)


def capture_decode_graphs(
    model: LlamaModel,
    cache: PagedKVCache,
    backend: AttentionBackend,
    buckets: tuple[int, ...],
    config: RunnerConfig,
    device: str,
    max_model_len: int,
) -> DecodeGraphs | CudaDecodeGraphs:
    """Compile the decode forward for every bucket: CUDA graphs on CUDA; on the CPU torch.compile (the
    first start on a machine; later ones hit the cache)."""
    width = -(-max_model_len // config.block_size)
    started = time.monotonic()
    if device.startswith("cuda"):
        buckets = buckets_up_to(buckets, config.max_num_seqs)  # a graphed step has a row per sequence
        cuda = CudaDecodeGraphs(model, cache, backend, buckets, width)
        log.info("capturing CUDA graphs of the decode step", buckets=",".join(map(str, buckets)))
        torch.cuda.synchronize()
        cuda.capture_all()
        torch.cuda.synchronize()
        log.info("captured CUDA graphs of the decode step", seconds=round(time.monotonic() - started, 1))
        return cuda
    configured = config.compile_cache_dir
    directory = Path(configured) if configured else cache_dir() / "inductor"
    graphs = DecodeGraphs(model, cache, backend, buckets, width, directory)
    log.info("compiling the decode step", buckets=",".join(map(str, buckets)), cache_dir=str(directory))
    captured = graphs.capture_all()
    log.info(
        "compiled the decode step",
        seconds=round(time.monotonic() - started, 1),
        buckets=len(captured),
        inductor_cache_hits=sum(c.cache_hits for c in captured),
        inductor_cache_misses=sum(c.cache_misses for c in captured),
    )
    return graphs
