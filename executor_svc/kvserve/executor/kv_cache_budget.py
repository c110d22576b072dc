"""How many KV blocks the model runner's cache gets, device and CPU swap alike.

A block costs the model's K/V for `block_size` tokens and, under `--speculative draft`, the draft
model's beside it (both caches hold the same block ids). On the CPU the budget is `--kv-cache-gb`
(default `kvserve.config.defaults.KV_CACHE_GB_CPU`); on CUDA it is `--kv-cache-gb` when set, else
what a profiling forward at the largest batch leaves of `--gpu-memory-utilization`. Apart from
`model_runner.ModelRunner` because the sizing is arithmetic and a CUDA measurement, not the runner's
composition.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
import torch

from kvserve.config import defaults
from kvserve.executor.model.draft_model import DraftModel
from kvserve.executor.model.kv_cache import CacheGeometry
from kvserve.executor.runner_config import RunnerConfig
from kvserve.protos.kv_geometry import GIB

log = structlog.get_logger(__name__)


def kv_bytes_per_block(geometry: CacheGeometry, draft: DraftModel | None) -> int:
    """One block's K/V: the model's, and the draft model's beside it."""
    per_block = geometry.bytes_per_block
    if draft is not None:
        per_block += draft.geometry.bytes_per_block
    return per_block


def blocks_for_bytes(budget_bytes: float, bytes_per_block: int) -> int:
    """Blocks a KV budget holds (none for a budget below zero)."""
    return max(0, int(budget_bytes // bytes_per_block))


def device_kv_budget_bytes(config: RunnerConfig, device: str, peak_activation_bytes: Callable[[], int]) -> float:
    """The device's KV budget: `--kv-cache-gb` (its CPU default off CUDA), else on CUDA what the
    profiling forward (`peak_activation_bytes`, run only then) leaves of the memory fraction."""
    if not device.startswith("cuda"):
        budget = config.kv_cache_gb if config.kv_cache_gb is not None else defaults.KV_CACHE_GB_CPU
        return budget * GIB
    if config.kv_cache_gb is not None:
        return config.kv_cache_gb * GIB
    return profile_free_cuda_bytes(config.gpu_memory_utilization, peak_activation_bytes)


def profile_free_cuda_bytes(gpu_memory_utilization: float, peak_activation_bytes: Callable[[], int]) -> float:
    """Run a forward at the largest batch, then give the KV cache what is left of the fraction."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    in_use = total - free
    peak = peak_activation_bytes()
    budget = total * gpu_memory_utilization - in_use - peak
    log.info(
        "profiled CUDA memory",
        total_gib=round(total / GIB, 2),
        weights_gib=round(in_use / GIB, 2),
        activations_gib=round(peak / GIB, 2),
        kv_gib=round(budget / GIB, 2),
    )
    return max(0.0, budget)
