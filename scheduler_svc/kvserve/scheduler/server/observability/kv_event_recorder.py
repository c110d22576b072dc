"""The prefix tree's changes as vLLM KV events: the listener the scheduler's tree reports to.

Only full blocks are events: a router matches whole blocks, and kvserve's partial tail blocks
(the last, short block of a finished sequence) stay private. Each stored block's hash chains
from its parent's (`kvserve.protos.kv_events.block_hash`), kept here by block id until the
block is evicted. Consecutive stores down one chain merge into one `BlockStored`, as vLLM
sends them. The engine takes the events once per step (`take`) and publishes them as a batch.
A block cached under a LoRA adapter says so as vLLM does: `lora_name` is the adapter's name and
`lora_id` its integer id (`served_models.ServedModels.lora_ids`; both None for the base model);
the adapter of a block is its namespace's (`lora_of`, the service's `namespace_lora`).

Blocks stored in the tiers below the pool (`--kv-host-gb`, `--kv-disk-dir`) are announced again
under their tier's medium (`CPU` or `DISK`, vLLM's names), with the same hash, and removed under it
when the tier lets go of them: a router that reads `medium` knows a prefix is a load away, not a
prefill. The tiers' keys are not the events' hashes (they are seeded with the executor's
fingerprint too), so the hash of each block below the pool is kept by key.
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.protos.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    block_hash,
)
from kvserve.scheduler.core import PrefixNode


class KvEventRecorder:
    """A `PrefixTreeListener` that turns inserts, evictions and clears into pending KV events."""

    def __init__(self, block_size: int, lora_of: Callable[[str], tuple[int, str]] = lambda _: (0, "")) -> None:
        self._block_size = block_size
        self._lora_of = lora_of
        self._hashes: dict[int, int] = {}
        """block id -> hash, for every full block in the tree."""
        self._pending: list[KvEvent] = []
        self._below: dict[int, int] = {}
        """tier key -> hash, for every block the tiers below the pool hold that an event announced."""

    def stored(self, node: PrefixNode) -> None:
        if len(node.key) != self._block_size:
            return
        parent = node.parent
        parent_hash = self._hashes.get(parent.block) if parent is not None else None
        digest = block_hash(parent_hash, node.namespace, node.key)
        self._hashes[node.block] = digest
        self._store(node, digest, parent_hash, MEDIUM_GPU)

    def stored_below(self, node: PrefixNode, key: int, medium: str) -> None:
        digest = self._hashes.get(node.block)
        if digest is None:
            return
        self._below[key] = digest
        parent = node.parent
        self._store(node, digest, self._hashes.get(parent.block) if parent is not None else None, medium)

    def removed(self, node: PrefixNode) -> None:
        digest = self._hashes.pop(node.block, None)
        if digest is not None:  # else a partial block: never announced
            self._remove([digest], MEDIUM_GPU)

    def dropped_below(self, keys: list[int], medium: str) -> None:
        self._remove([digest for key in keys if (digest := self._below.pop(key, None)) is not None], medium)

    def cleared(self) -> None:
        self._hashes.clear()
        self._below.clear()
        self._pending.append(AllBlocksCleared())

    def _store(self, node: PrefixNode, digest: int, parent_hash: int | None, medium: str) -> None:
        # Down one chain, stores merge into one event per medium: the last event, or the one before it
        # when the last is a store under the other medium (a block stored to the pool, then below it).
        for back in (1, 2):
            last = self._pending[-back] if len(self._pending) >= back else None
            if not isinstance(last, BlockStored):
                break
            if last.medium == medium:
                if parent_hash is not None and last.block_hashes[-1] == parent_hash:
                    last.block_hashes.append(digest)
                    last.token_ids.extend(node.key)
                    return
                break
        lora_id, lora_name = self._lora_of(node.namespace)
        self._pending.append(
            BlockStored(
                block_hashes=[digest],
                parent_block_hash=parent_hash,
                token_ids=list(node.key),
                block_size=self._block_size,
                lora_id=lora_id or None,
                medium=medium,
                lora_name=lora_name or None,
            )
        )

    def _remove(self, digests: list[int], medium: str) -> None:
        if not digests:
            return
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.extend(digests)
        else:
            self._pending.append(BlockRemoved(block_hashes=digests, medium=medium))

    def take(self) -> list[KvEvent]:
        """The events since the last call, in order."""
        events, self._pending = self._pending, []
        return events

    def cached_hashes(self) -> set[int]:
        """The hashes of every full block in the tree now (what a subscriber should have rebuilt)."""
        return set(self._hashes.values())
