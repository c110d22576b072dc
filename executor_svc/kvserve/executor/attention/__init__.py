"""Attention backends behind one interface: `cpu` (kvserve's CPU kernels, the CPU default), `torch`
(plain torch, any device) and `triton` (the CUDA default)."""

from kvserve.executor.attention.base import AttentionBackend, AttentionMetadata
from kvserve.executor.attention.registry import create_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "create_backend"]
