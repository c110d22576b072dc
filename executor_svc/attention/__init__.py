"""Attention backends behind one interface: `torch` (CPU default) and `triton` (CUDA default)."""

from executor_svc.attention.base import AttentionBackend, AttentionMetadata
from executor_svc.attention.registry import create_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "create_backend"]
