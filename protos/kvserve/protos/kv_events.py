"""KV-cache events in vLLM's format, for KV-aware routers (NVIDIA Dynamo, llm-d), and the block hash they carry.

A router that reads vLLM's events can read kvserve's. The schema is vLLM's
(`vllm/distributed/kv_events.py`): msgspec structs, msgpack-encoded. A batch is an array,
`[ts, events, data_parallel_rank]`; each event a map tagged by `type`: `{"type": "BlockStored",
"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
"lora_name"}`, `{"type": "BlockRemoved", "block_hashes", "medium"}` or `{"type":
"AllBlocksCleared"}`. That is the form vllm-router's `kv_aware` policy decodes: it refuses a
map for the batch ("KV event batch must be an array") and an array for an event ("KV event
must be a tagged map").
Over ZeroMQ each batch is one PUB message of three frames, `(topic, seq, payload)`, `seq` an
8-byte big-endian counter; a ROUTER socket replays missed batches from a given `seq`, then
sends `seq = -1` with an empty payload.

**The block hash** is defined here and nowhere else. It is chained over full blocks: a
block's hash covers its token ids and its parent's hash, so equal hashes mean equal whole
prefixes. The first block of a prefix chains from a seed made of its prefix namespace (itself
a hash of model, tenant and cache salt, and the LoRA adapter's name), so the same tokens under
two tenants (or two adapters) never hash alike, and no event says whose tokens they are. 64 bits
of BLAKE2b, as an unsigned integer.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import msgspec

MEDIUM_GPU = "GPU"
"""vLLM's name for device KV blocks (kvserve's CPU executor's blocks are its device blocks too)."""
MEDIUM_CPU = "CPU"
"""vLLM's name for blocks offloaded to host memory (kvserve's `--kv-host-gb` tier)."""
MEDIUM_DISK = "DISK"
"""Blocks in kvserve's `--kv-disk-dir` tier."""
END_SEQ = -1
"""The `seq` that ends a replay."""
_SEED_DOMAIN = b"kvserve.kv-events.v1\x00"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change to the prefix cache (tagged by its class name, as vLLM tags them)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    """A chain of consecutive full blocks, parent first."""
    parent_block_hash: int | None
    """The hash of the block before the first one; None at the start of a prefix."""
    token_ids: list[int]
    """The blocks' tokens, `block_size` per hash."""
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


def block_hash(parent: int | None, namespace: str, token_ids: Sequence[int]) -> int:
    """The hash of the full block holding `token_ids` after the block hashed `parent` (None: the first
    block of a prefix in `namespace`)."""
    digest = hashlib.blake2b(digest_size=8)
    if parent is None:
        digest.update(_SEED_DOMAIN + namespace.encode("utf-8"))
    else:
        digest.update(parent.to_bytes(8, "big"))
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(digest.digest(), "big")


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(data: bytes) -> int:
    return int.from_bytes(data, "big", signed=True)
