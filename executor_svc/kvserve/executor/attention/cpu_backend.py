"""Attention through kvserve's own CPU kernels (`kernels/cpu/`): the CPU default.

A token's attention output from these kernels is bit-identical however the token was batched,
chunked, cached or recomputed (`kvserve.kernels.cpu_ops`), which torch's CPU attention does not give.
They read the cache in the head-major block layout (`kvserve.executor.model.kv_cache`).

The kernels are compiled once per machine and torch version into `$KVSERVE_CACHE/kernels`
(about 20 s; `scripts/setup.sh` does it ahead of the first start):
`python -m kvserve.executor.attention.cpu_backend` builds them and prints where.
"""

from __future__ import annotations

import time
from pathlib import Path

import structlog
import torch

from kvserve.executor.attention.base import HEAD_MAJOR, AttentionMetadata
from kvserve.executor.disk_cache import cache_dir
from kvserve.kernels import cpu_ops

log = structlog.get_logger(__name__)


def build_root() -> Path:
    return cache_dir() / "kernels"


def ensure_kernels() -> Path:
    """Load the CPU kernels, compiling them first when this machine has no build of them yet."""
    root = build_root()
    if cpu_ops.is_built(root):
        return cpu_ops.load(root)
    log.info("compiling the CPU kernels (once per machine and torch version)", into=str(root / cpu_ops.build_name()))
    started = time.monotonic()
    try:
        loaded = cpu_ops.load(root)
    except (OSError, RuntimeError) as exc:  # no compiler, no ninja, a read-only cache
        raise RuntimeError(
            f"building kvserve's CPU kernels into {root} failed ({exc}); they need a C++ compiler (g++), "
            "the Python headers and ninja (a kvserve dependency). --attention-backend torch --no-batch-invariant "
            "runs without them, giving up batch invariance"
        ) from exc
    log.info("compiled the CPU kernels", seconds=round(time.monotonic() - started, 1))
    return loaded


class CpuAttentionBackend:
    name = "cpu"
    kv_layout = HEAD_MAJOR

    def __init__(self) -> None:
        ensure_kernels()

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.prepared = None

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        cpu_ops.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)

    def forward(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return cpu_ops.paged_attention(
            query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.scale
        )


if __name__ == "__main__":
    print(ensure_kernels())
