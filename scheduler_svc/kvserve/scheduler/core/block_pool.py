"""Reference-counted KV block accounting: which device blocks are free, cached or in use.

Every block is in exactly one of three states:

- **free**: ref count 0 and holding nothing matchable; kept on a LIFO stack.
- **cached**: ref count 0 but registered in the prefix tree, so a later request can
  still reuse it. Kept in an `OrderedDict` in release order, which is LRU order:
  the front is evicted first. A sequence releases its table tail-first, so the tail
  of a chain sits ahead of its parents and only leaves are ever evicted.
- **referenced**: ref count > 0 (held by one or more live sequences' block tables).

Allocation takes free blocks first and evicts cached ones only when none are free, so a
cache hit survives as long as possible. Every operation is O(1) per block; the
`OrderedDict` is a C doubly linked list, which gives O(1) removal from the middle when a
cached block is hit again.

Under a preallocating `kv_reservation` policy, `num_reserved` free-or-cached blocks are
promised to admitted sequences (a count, not particular blocks): `allocate` never hands
them to anyone else, so a sequence's growth into its reservation cannot fail.

Three monotonic counters account for every reference: `num_allocated_total` (blocks handed
out by `allocate`), `num_shared_total` (references added by `ref`) and `num_released_total`
(references dropped by `release`); allocated + shared - released = the sum of ref counts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable


class BlockPool:
    """Device KV blocks `0 .. num_blocks-1` with ref counts, a free stack and an LRU of cached blocks."""

    __slots__ = (
        "_cached",
        "_evict_hook",
        "_free",
        "_is_cached",
        "num_allocated_total",
        "num_blocks",
        "num_evicted_total",
        "num_released_total",
        "num_reserved",
        "num_shared_total",
        "ref_counts",
    )

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        # Reversed so that block 0 is handed out first (readable plans and dumps).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._is_cached: list[bool] = [False] * num_blocks
        self._evict_hook: Callable[[int], None] = _no_hook
        # Free or cached blocks promised to admitted sequences (kv_reservation); others cannot allocate them.
        self.num_reserved = 0
        # Monotonic since the pool was built: blocks handed out by allocate/allocate_one, references
        # added by ref (prefix hits, forks, copy pins), references dropped by release, and cached
        # blocks evicted (taken back from the prefix tree to be handed out).
        self.num_allocated_total = 0
        self.num_evicted_total = 0
        self.num_shared_total = 0
        self.num_released_total = 0

    def set_evict_hook(self, hook: Callable[[int], None]) -> None:
        """`hook(block_id)` is called when a cached block is evicted, so the tree can drop it."""
        self._evict_hook = hook

    # --- figures -----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks holding nothing reusable."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks still matchable in the prefix tree (evictable)."""
        return len(self._cached)

    @property
    def num_allocatable(self) -> int:
        """Blocks an allocation may take now: free + cached, less those reserved for admitted sequences."""
        return len(self._free) + len(self._cached) - self.num_reserved

    @property
    def num_referenced(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    # --- operations --------------------------------------------------------------------

    def allocate(self, count: int) -> list[int] | None:
        """Take `count` blocks with ref count 1, or return None and change nothing."""
        free = self._free
        if count > len(free) + len(self._cached) - self.num_reserved:
            return None
        self.num_allocated_total += count
        refs = self.ref_counts
        if count <= len(free):
            blocks = free[len(free) - count :]
            del free[len(free) - count :]
        else:
            blocks = free[:]
            free.clear()
            cached, is_cached, hook = self._cached, self._is_cached, self._evict_hook
            self.num_evicted_total += count - len(blocks)
            for _ in range(count - len(blocks)):
                block, _unused = cached.popitem(last=False)
                is_cached[block] = False
                hook(block)
                blocks.append(block)
        for block in blocks:
            refs[block] = 1
        return blocks

    def allocate_one(self) -> int | None:
        """The decode fast path of `allocate(1)`."""
        if self.num_reserved and len(self._free) + len(self._cached) <= self.num_reserved:
            return None
        if self._free:
            block = self._free.pop()
        elif self._cached:
            block, _unused = self._cached.popitem(last=False)
            self._is_cached[block] = False
            self._evict_hook(block)
            self.num_evicted_total += 1
        else:
            return None
        self.ref_counts[block] = 1
        self.num_allocated_total += 1
        return block

    def reserve(self, count: int) -> None:
        """Promise `count` more of the allocatable blocks to a sequence (the caller checked the room)."""
        if count > self.num_allocatable:
            raise ValueError(f"cannot reserve {count} blocks: only {self.num_allocatable} are allocatable")
        self.num_reserved += count

    def unreserve(self, count: int) -> None:
        """Give back `count` reserved blocks (the sequence ended or is about to allocate them)."""
        if count > self.num_reserved:
            raise ValueError(f"cannot unreserve {count} blocks: only {self.num_reserved} are reserved")
        self.num_reserved -= count

    def ref(self, block: int) -> None:
        """Add a reference to a block that is referenced or cached (a prefix hit or a fork)."""
        count = self.ref_counts[block]
        if count == 0:
            if not self._is_cached[block]:
                raise ValueError(f"block {block} is free; only cached or referenced blocks can be shared")
            del self._cached[block]
        self.ref_counts[block] = count + 1
        self.num_shared_total += 1

    def release(self, block: int) -> None:
        """Drop one reference; at zero the block becomes cached (if in the tree) or free."""
        count = self.ref_counts[block] - 1
        if count < 0:
            raise ValueError(f"block {block} released more often than referenced")
        self.ref_counts[block] = count
        self.num_released_total += 1
        if count == 0:
            if self._is_cached[block]:
                self._cached[block] = None
            else:
                self._free.append(block)

    def release_table(self, blocks: Iterable[int]) -> None:
        """Release a block table tail-first, so chain tails are evicted before their parents."""
        for block in reversed(list(blocks)):
            self.release(block)

    def mark_cached(self, block: int) -> None:
        """The tree now holds this (referenced) block: at ref count 0 it stays matchable."""
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} must be referenced when it enters the prefix tree")
        self._is_cached[block] = True

    def is_cached(self, block: int) -> bool:
        return self._is_cached[block]

    # --- introspection (invariants, dumps, tests) ----------------------------------------

    def free_blocks(self) -> list[int]:
        return list(self._free)

    def cached_blocks_lru(self) -> list[int]:
        """Cached blocks, next-to-evict first."""
        return list(self._cached)


class CpuBlockPool:
    """CPU swap space: plain block ids with single ownership (a swapped-out sequence)."""

    __slots__ = ("_free", "num_blocks")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        blocks = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        return blocks

    def release(self, blocks: Iterable[int]) -> None:
        self._free.extend(blocks)

    def free_blocks(self) -> list[int]:
        return list(self._free)


def _no_hook(block: int) -> None:
    """Default eviction hook (no prefix tree attached)."""
