"""The prefix cache: a block trie over token ids, one root per namespace.

It is a trie of physical KV blocks, not a node-splitting radix tree: each node stands
for one block and is keyed, under its parent, by the tuple of token ids the block
holds. A full block's key has `block_size` tokens; a sequence's last, partial block may
be added when it ends (a *tail* node, shorter key, always a leaf). Because every edge
is exactly one block, lookups are one dict probe per block (tuple hashing runs in C)
and edges never need splitting.

Only the last block matches at token granularity: after the full blocks, the child
sharing the longest prefix with the remaining tokens is reported with the number of
matching slots, and the scheduler copies that block instead of recomputing those tokens.

Eviction is driven by the `BlockPool`: it evicts cached blocks in LRU order, and the
structure guarantees the evicted block's node is a leaf (see `BlockPool`). The tree only
unlinks it. Namespaces never share nodes, so two tenants never share KV.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from kvserve.scheduler.core.block_pool import BlockPool


class PrefixNode:
    """One trie node = one cached physical block: its token ids (the key under `parent`) and its block id.

    `hits` and `last_used` are for people (the engine view), not for eviction, which the
    pool's LRU drives: lookups that reused this block, and when it was made or last reused.
    """

    __slots__ = ("block", "children", "disk_key", "hits", "key", "last_used", "namespace", "parent")

    def __init__(
        self, key: tuple[int, ...], block: int, parent: PrefixNode | None, namespace: str, now: float = 0.0
    ) -> None:
        self.key = key
        self.block = block
        self.parent = parent
        self.children: dict[tuple[int, ...], PrefixNode] = {}
        self.namespace = namespace
        self.hits = 0
        self.last_used = now
        """`time.monotonic()` seconds."""
        self.disk_key = 0
        """The block's key in the disk tier (`disk_tier.DiskTier.key_of`), once computed; 0: not yet."""

    def ancestor(self, levels_up: int) -> PrefixNode:
        """The node `levels_up` blocks closer to the root."""
        node = self
        for _ in range(levels_up):
            assert node.parent is not None
            node = node.parent
        return node


@dataclass(slots=True)
class PrefixMatch:
    """What a lookup found: reuse `full_blocks` as they are, copy `partial_slots` of `partial_block`."""

    num_tokens: int = 0
    """Prompt tokens whose KV is reused: len(full_blocks) * block_size + partial_slots."""
    full_blocks: list[int] = field(default_factory=list)
    node: PrefixNode | None = None
    """The node of the last full block; None when no full block matched (extend the root)."""
    partial_block: int | None = None
    partial_slots: int = 0


class PrefixTreeListener(Protocol):
    """Told of every change to the tree's contents, in order (KV events for routers)."""

    def stored(self, node: PrefixNode) -> None:
        """`node` was added (its parent is attached)."""

    def removed(self, node: PrefixNode) -> None:
        """`node`, a leaf, is being evicted (its parent is still attached)."""

    def cleared(self) -> None:
        """Everything is gone: the executor's KV was lost."""

    def stored_below(self, node: PrefixNode, key: int, medium: str) -> None:
        """`node`'s block was also stored in the tiers below the pool (`medium`) under `key`."""

    def dropped_below(self, keys: list[int], medium: str) -> None:
        """The tiers below the pool no longer hold `keys`."""


class PrefixTree:
    """Block trie (one node per KV block, one root per namespace) with a token-granular last-block match.

    Match and insert run over `BlockPool` blocks; nodes are dropped when the pool evicts them.
    `listener`, when set, hears every insert, eviction and clear.
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.block_size = block_size
        self._pool = pool
        self._roots: dict[str, PrefixNode] = {}
        self._node_of_block: dict[int, PrefixNode] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.listener: PrefixTreeListener | None = None
        pool.set_evict_hook(self._on_evict)

    # --- lookup ------------------------------------------------------------------------

    def root(self, namespace: str) -> PrefixNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = PrefixNode((), -1, None, namespace)
        return root

    def match(self, namespace: str, token_ids: list[int], max_tokens: int, *, count: bool = True) -> PrefixMatch:
        """Longest cached prefix of `token_ids[:max_tokens]`, at token granularity.

        `max_tokens` is len(token_ids) - 1 for admission: at least one token is always left to
        compute, so there are logits to sample from. `count=False` peeks without touching the
        hit counters (the cache-aware order uses it to rank candidates).
        """
        bs = self.block_size
        root = self._roots.get(namespace)
        if count:
            self.queried_tokens += max_tokens
        if root is None:
            return PrefixMatch()
        node = root
        path: list[PrefixNode] = []
        pos = 0
        children = node.children
        while pos + bs <= max_tokens and children:
            child = children.get(tuple(token_ids[pos : pos + bs]))
            if child is None:
                break
            path.append(child)
            node = child
            children = child.children
            pos += bs
        partial: PrefixNode | None = None
        partial_slots = 0
        if pos < max_tokens and children:
            rest = token_ids[pos : min(pos + bs, max_tokens)]
            first = rest[0]
            for key, child in children.items():
                if key[0] != first:
                    continue
                slots = _common_prefix_len(key, rest)
                if slots > partial_slots:
                    partial, partial_slots = child, slots
        matched = pos + partial_slots
        if count:
            self.hit_tokens += matched
            _count_hits(path if partial is None else [*path, partial])
        blocks = [n.block for n in path]
        partial_block = None if partial is None else partial.block
        return PrefixMatch(matched, blocks, node if blocks else None, partial_block, partial_slots)

    def node_of(self, block: int) -> PrefixNode | None:
        return self._node_of_block.get(block)

    # --- insert ------------------------------------------------------------------------

    def insert(self, namespace: str, parent: PrefixNode | None, key: tuple[int, ...], block: int) -> PrefixNode | None:
        """Add `block` (holding `key`) under `parent` (None: the namespace root); return its node.

        Returns None when `parent` already has a node for the same key (another sequence
        computed the same tokens into a different block): the caller's block stays private.
        The block must be referenced by the caller at this point.
        """
        if parent is None:
            parent = self.root(namespace)
        if key in parent.children:
            return None
        if block in self._node_of_block:
            raise ValueError(f"block {block} is already in the prefix tree")
        node = PrefixNode(key, block, parent, parent.namespace, time.monotonic())
        parent.children[key] = node
        self._node_of_block[block] = node
        self._pool.mark_cached(block)
        if self.listener is not None:
            self.listener.stored(node)
        return node

    def clear(self) -> None:
        """Forget everything (the executor's KV is gone). The pool must be rebuilt too."""
        self._roots.clear()
        self._node_of_block.clear()
        if self.listener is not None:
            self.listener.cleared()

    # --- eviction ------------------------------------------------------------------------

    def _on_evict(self, block: int) -> None:
        node = self._node_of_block.pop(block)
        if node.children:
            raise AssertionError(
                f"evicting block {block} whose node still has "
                f"{len(node.children)} children: eviction must take leaves only"
            )
        parent = node.parent
        assert parent is not None
        if self.listener is not None:
            self.listener.removed(node)
        del parent.children[node.key]
        node.parent = None
        if not parent.children and parent.parent is None:
            self._roots.pop(parent.namespace, None)  # drop an empty namespace

    # --- introspection -------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return len(self._node_of_block)

    def namespaces(self) -> list[str]:
        return list(self._roots)

    def nodes(self) -> list[PrefixNode]:
        return list(self._node_of_block.values())

    def is_attached(self, node: PrefixNode) -> bool:
        """True while `node` is reachable from its namespace root."""
        while node.parent is not None:
            if node.parent.children.get(node.key) is not node:
                return False
            node = node.parent
        return self._roots.get(node.namespace) is node


def _count_hits(nodes: list[PrefixNode]) -> None:
    if nodes:
        now = time.monotonic()
        for node in nodes:
            node.hits += 1
            node.last_used = now


def _common_prefix_len(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
