"""The prefix tree's changes as vLLM KV events: the listener the scheduler's tree reports to.

Only full blocks are events: a router matches whole blocks, and kvserve's partial tail blocks
(the last, short block of a finished sequence) stay private. Each stored block's hash chains
from its parent's (`kvserve.protos.kv_events.block_hash`), kept here by block id until the
block is evicted. Consecutive stores down one chain merge into one `BlockStored`, as vLLM
sends them. The engine takes the events once per step (`take`) and publishes them as a batch.
A block cached under a LoRA adapter says so as vLLM does: `lora_name` is the adapter's name and
`lora_id` its integer id (`served_models.ServedModels.lora_ids`; both None for the base model);
the adapter of a block is its namespace's (`lora_of`, the service's `namespace_lora`).
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

    def stored(self, node: PrefixNode) -> None:
        if len(node.key) != self._block_size:
            return
        parent = node.parent
        parent_hash = self._hashes.get(parent.block) if parent is not None else None
        digest = block_hash(parent_hash, node.namespace, node.key)
        self._hashes[node.block] = digest
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockStored) and parent_hash is not None and last.block_hashes[-1] == parent_hash:
            last.block_hashes.append(digest)
            last.token_ids.extend(node.key)
            return
        lora_id, lora_name = self._lora_of(node.namespace)
        self._pending.append(
            BlockStored(
                block_hashes=[digest],
                parent_block_hash=parent_hash,
                token_ids=list(node.key),
                block_size=self._block_size,
                lora_id=lora_id or None,
                medium=MEDIUM_GPU,
                lora_name=lora_name or None,
            )
        )

    def removed(self, node: PrefixNode) -> None:
        digest = self._hashes.pop(node.block, None)
        if digest is None:
            return  # a partial block: never announced
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(digest)
        else:
            self._pending.append(BlockRemoved(block_hashes=[digest], medium=MEDIUM_GPU))

    def cleared(self) -> None:
        self._hashes.clear()
        self._pending.append(AllBlocksCleared())

    def take(self) -> list[KvEvent]:
        """The events since the last call, in order."""
        events, self._pending = self._pending, []
        return events

    def cached_hashes(self) -> set[int]:
        """The hashes of every full block in the tree now (what a subscriber should have rebuilt)."""
        return set(self._hashes.values())
