"""The real executor's disk tier: what a block's KV depends on, and the paged cache's blocks as bytes.

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


class PagedBlocks:
    """The paged cache's blocks as the disk tier stores them (`plan_blocks.BlockBytes`): K and V of every layer."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.tensor = cache.tensor
        self._block_shape = cache.tensor[:, :, 0].shape
        self._block_bytes = cache.tensor[:, :, 0].numel() * cache.tensor.element_size()

    def block_bytes(self, block: int) -> bytes:
        return self.tensor[:, :, block].contiguous().view(torch.uint8).cpu().numpy().tobytes()

    def load_block(self, block: int, payload: bytes) -> bool:
        if len(payload) != self._block_bytes:
            return False
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self.tensor[:, :, block].copy_(raw.view(self.tensor.dtype).view(self._block_shape))
        return True
