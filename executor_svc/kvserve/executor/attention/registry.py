"""Which attention backend a name selects.

Kept apart from `base` so the interface module imports no backend: each backend imports
`base`, and only this registry imports the backends (lazily, so the torch path never
loads triton).
"""

from __future__ import annotations

from kvserve.executor.attention.base import AttentionBackend

BACKENDS = ("cpu", "torch", "triton")


def create_backend(name: str) -> AttentionBackend:
    """A fresh backend of the given name (one of BACKENDS)."""
    if name == "cpu":
        from kvserve.executor.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    if name == "torch":
        from kvserve.executor.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from kvserve.executor.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
