"""The host-memory tier of the prefix cache: KV blocks by key in this process's memory, bounded, LRU.

Why: between the device pool and the disk. A block the pool evicted is read back from memory
without a file read and without a disk at all (`--kv-host-gb` alone), and with a disk tier too it
spares the disk the hottest blocks. On a CPU the pool is host memory already, so this tier only
moves the bound (the pool is sized for the step, this for the working set of prefixes); on CUDA it
is where the device's evictions land first.

A block is `bytes`, as the disk tier holds it (`plan_blocks.BlockBytes`), under the scheduler's key.
Keys the tier lets go of are remembered until `take_dropped`, so the scheduler stops planning loads
that would miss.
"""

from __future__ import annotations

from collections import OrderedDict


class HostBlockStore:
    """At most `capacity_bytes` of block payloads, least recently used first out."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes ≥ 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        """key -> payload, least recently used first (an OrderedDict's move_to_end and popitem are O(1))."""
        self._dropped: list[int] = []

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def put(self, key: int, payload: bytes) -> None:
        """Hold `payload` under `key` (equal keys mean equal content: a key held only becomes the most
        recently used), evicting the least recently used blocks it needs room from."""
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return
        if len(payload) > self.capacity_bytes:
            self._dropped.append(key)
            return
        while self.num_bytes + len(payload) > self.capacity_bytes:
            victim, old = self._blocks.popitem(last=False)
            self.num_bytes -= len(old)
            self._dropped.append(victim)
        self._blocks[key] = payload
        self.num_bytes += len(payload)

    def get(self, key: int) -> bytes | None:
        """Block `key`'s payload (now the most recently used), or None."""
        payload = self._blocks.get(key)
        if payload is not None:
            self._blocks.move_to_end(key)
        return payload

    def take_dropped(self) -> list[int]:
        """The keys let go of since the last call (evicted, or too big to hold)."""
        dropped, self._dropped = self._dropped, []
        return [key for key in dropped if key not in self._blocks]
