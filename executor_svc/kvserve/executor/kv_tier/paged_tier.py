"""The real executor's disk tier: a plan's stores and loads between the paged KV cache and the disk store.

A block's bytes are its K and V in every layer, exactly as the cache holds them (the attention
backend's layout, the KV dtype), so a loaded block holds the very bits its computation wrote: with
batch-invariant kernels, a prefix read back from disk gives the same tokens as computing it.

What else those bits depend on is the fingerprint (`kv_fingerprint`), which seeds every block key
the scheduler computes and sits in every file's header: the weights' contents (not their names),
the dtypes, the weight format, the cache layout and geometry, torch's version and the CPU's vector
units (another kernel may round otherwise). A directory written under any other fingerprint is
never read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import structlog
import torch

from kvserve.executor.cpu_features import cpu_flags
from kvserve.executor.disk_cache import cache_dir
from kvserve.executor.kv_tier.disk_store import DiskBlockStore
from kvserve.executor.model.kv_cache import PagedKVCache

log = structlog.get_logger(__name__)

_FORMAT = "kvserve-kv-1"
_VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
"""The CPU features a kernel's choice (and with it a sum's rounding) may depend on."""
_DIGESTS_FILE = "weights-digests.json"
_READ_CHUNK = 1 << 22


def weights_digest(files: Iterable[Path]) -> str:
    """A digest of the weight files' contents, remembered per (path, size, mtime) in kvserve's cache
    directory: hashing a model's weights takes a second per GB, once."""
    memo_path = cache_dir() / _DIGESTS_FILE
    try:
        memo: dict[str, str] = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    total = hashlib.sha256()
    changed = False
    for path in sorted(files):
        stat = path.stat()
        memo_key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
        digest = memo.get(memo_key)
        if digest is None:
            file_hash = hashlib.blake2b(digest_size=16)
            with path.open("rb") as handle:
                while chunk := handle.read(_READ_CHUNK):
                    file_hash.update(chunk)
            digest = memo[memo_key] = file_hash.hexdigest()
            changed = True
        total.update(f"{path.name}:{digest};".encode())
    if changed:
        try:
            memo_path.parent.mkdir(parents=True, exist_ok=True)
            memo_path.write_text(json.dumps(memo))
        except OSError as exc:
            log.warning("could not remember the weights' digest", path=str(memo_path), error=str(exc))
    return total.hexdigest()[:32]


def kv_fingerprint(weights: str, cache: PagedKVCache, dtype: str, weights_mode: str, device: str) -> str:
    """Everything besides its tokens that a KV block's bits depend on."""
    g = cache.geometry
    flags = cpu_flags()
    vector = ",".join(flag for flag in _VECTOR_FLAGS if flag in flags) if device == "cpu" else device
    return (
        f"{_FORMAT}|weights={weights}|dtype={dtype}|kv={g.dtype}|format={weights_mode}|layout={g.layout}"
        f"|geometry={g.num_layers}x{g.num_kv_heads}x{g.head_dim}x{g.block_size}|torch={torch.__version__}"
        f"|device={torch.device(device).type}|cpu={vector}"
    )


class PagedDiskTier:
    """Moves whole blocks of `cache` to and from `store`."""

    def __init__(self, cache: PagedKVCache, store: DiskBlockStore, fingerprint: str) -> None:
        self.cache = cache
        self.store = store
        self.fingerprint = fingerprint
        self._block_shape = cache.tensor[:, :, 0].shape
        self._block_bytes = cache.tensor[:, :, 0].numel() * cache.tensor.element_size()

    def run(self, stores: list[tuple[int, int]], loads: list[tuple[int, int]]) -> list[int]:
        """A plan's stores (first: the plan may reuse those blocks), then its loads; the blocks whose load
        failed (a missing or bad file: the store counts and logs it)."""
        tensor = self.cache.tensor
        for block, key in stores:
            data = tensor[:, :, block].contiguous().view(torch.uint8).cpu()
            self.store.put(key, data.numpy().tobytes())
        failed = []
        for block, key in loads:
            payload = self.store.get(key)
            if payload is None or len(payload) != self._block_bytes:
                failed.append(block)
                continue
            raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            tensor[:, :, block].copy_(raw.view(tensor.dtype).view(self._block_shape))
        return failed

    def close(self) -> None:
        self.store.close()
