"""How the model runner is configured: which model, where, and how much KV memory."""

from __future__ import annotations

from dataclasses import dataclass

from protos import defaults


@dataclass(slots=True)
class RunnerConfig:
    """Every knob of `ModelRunner`; "auto" values are resolved once at start-up."""

    model: str | None = None
    """None or the default model's name, an HF directory, or a .gguf path (see model_store.resolve_source)."""
    device: str = "auto"
    """"auto" picks cuda when available, else cpu."""
    dtype: str = "auto"
    """"auto" is float32 on cpu and bfloat16 on cuda."""
    attention_backend: str = "auto"
    """"auto" is triton on cuda and torch on cpu."""
    block_size: int = defaults.BLOCK_SIZE
    kv_cache_gb: float | None = None
    """CPU: KV budget in GiB (default defaults.KV_CACHE_GB_CPU). CUDA: overrides gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.9
    swap_space_gb: float = 0.0
    """CPU swap space for swap-preemption; 0 disables it (num_cpu_blocks = 0)."""
    max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS
    """Size of the CUDA profiling forward pass that measures activation memory."""
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_model_len: int | None = None
    """Default: the model config's max_position_embeddings."""
    num_threads: int | None = None
    """torch intra-op threads on CPU. None: every usable CPU but one, which is left to the
    scheduler process and the link; oversubscribed OpenMP threads stall for whole seconds."""


def resolve_device(config: RunnerConfig) -> str:
    import torch

    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return config.device


def resolve_num_threads(config: RunnerConfig) -> int:
    import os

    if config.num_threads:
        return config.num_threads
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # With cores to spare, leave one to the scheduler process. On a small machine the
    # scheduler mostly idles while a step computes, so the executor takes every core.
    return usable - 1 if usable > 4 else usable


def resolve_dtype(config: RunnerConfig, device: str) -> str:
    if config.dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    if config.dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {config.dtype!r}")
    return config.dtype


def resolve_attention_backend(config: RunnerConfig, device: str) -> str:
    if config.attention_backend == "auto":
        return "triton" if device.startswith("cuda") else "torch"
    if config.attention_backend not in ("torch", "triton"):
        raise ValueError(f"attention_backend must be auto, torch or triton, got {config.attention_backend!r}")
    return config.attention_backend
