"""What a disk store holds, in memory: each block's file size, least recently used first, and their total.

Why in memory: `put` asks whether a key is stored on the executor's main thread, and `get` whether
to open a file at all, so neither touches the disk to learn it; the writer thread asks which blocks
to evict. Not thread-safe by itself: the store's lock guards it.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockIndex:
    """key -> file size in LRU order (oldest first), with the sizes' sum in `num_bytes`."""

    def __init__(self) -> None:
        self._sizes: OrderedDict[int, int] = OrderedDict()
        self.num_bytes = 0

    def __contains__(self, key: int) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[int]:
        return list(self._sizes)

    def add(self, key: int, size: int) -> None:
        """Record block `key` (a new one) as the most recently used."""
        self.remove(key)
        self._sizes[key] = size
        self.num_bytes += size

    def touch(self, key: int) -> None:
        """Make `key` the most recently used, if it is still here (a concurrent eviction may have taken it)."""
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def remove(self, key: int) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.num_bytes -= size

    def take_lru(self, size: int, capacity: int) -> list[int]:
        """Remove the least recently used blocks until `size` more bytes fit in `capacity`; their keys."""
        victims: list[int] = []
        while self._sizes and self.num_bytes + size > capacity:
            key, victim_size = self._sizes.popitem(last=False)
            self.num_bytes -= victim_size
            victims.append(key)
        return victims
