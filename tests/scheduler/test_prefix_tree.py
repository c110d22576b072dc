"""PrefixTree: token-granular matching, namespaces, leaf-only LRU eviction through the pool."""

from __future__ import annotations

from kvserve.scheduler.core.block_pool import BlockPool
from kvserve.scheduler.core.prefix_tree import PrefixTree

BS = 4


def cache_chain(tree: PrefixTree, pool: BlockPool, namespace: str, tokens: list[int]) -> list[int]:
    """Insert the full blocks of `tokens` as one sequence would, then release them (tail-first)."""
    blocks = pool.allocate(len(tokens) // BS)
    node = None
    for i, block in enumerate(blocks):
        node = tree.insert(namespace, node, tuple(tokens[i * BS : (i + 1) * BS]), block)
        assert node is not None
    pool.release_table(blocks)
    return blocks


def test_match_full_blocks_then_a_partial_block() -> None:
    pool = BlockPool(8)
    tree = PrefixTree(pool, BS)
    blocks = cache_chain(tree, pool, "m", list(range(12)))
    match = tree.match("m", [0, 1, 2, 3, 4, 5, 9, 9, 9], 8)
    assert match.full_blocks == [blocks[0]]
    assert (match.partial_block, match.partial_slots, match.num_tokens) == (blocks[1], 2, 6)
    assert match.node is tree.node_of(blocks[0])


def test_match_leaves_at_least_the_requested_tokens_uncomputed() -> None:
    pool = BlockPool(8)
    tree = PrefixTree(pool, BS)
    blocks = cache_chain(tree, pool, "m", list(range(8)))
    match = tree.match("m", list(range(8)), 7)  # the whole prompt is cached; one token must stay
    assert match.full_blocks == [blocks[0]]
    assert (match.partial_block, match.partial_slots, match.num_tokens) == (blocks[1], 3, 7)


def test_namespaces_share_nothing() -> None:
    pool = BlockPool(8)
    tree = PrefixTree(pool, BS)
    cache_chain(tree, pool, "tenant-a", list(range(8)))
    match = tree.match("tenant-b", list(range(9)), 8)
    assert (match.num_tokens, match.full_blocks, match.partial_block) == (0, [], None)
    assert tree.match("tenant-a", list(range(9)), 8).num_tokens == 8


def test_counters_track_queried_and_hit_tokens() -> None:
    pool = BlockPool(8)
    tree = PrefixTree(pool, BS)
    cache_chain(tree, pool, "m", list(range(8)))
    tree.match("m", list(range(6)) + [99, 99], 7)
    tree.match("x", [1, 2, 3], 2)
    tree.match("m", list(range(8)), 7, count=False)
    assert (tree.queried_tokens, tree.hit_tokens) == (9, 6)


def test_duplicate_insert_is_refused() -> None:
    pool = BlockPool(4)
    tree = PrefixTree(pool, BS)
    a, b = pool.allocate(2)
    assert tree.insert("m", None, (1, 2, 3, 4), a) is not None
    assert tree.insert("m", None, (1, 2, 3, 4), b) is None
    assert not pool.is_cached(b)


def test_eviction_is_lru_with_chain_tails_before_parents() -> None:
    pool = BlockPool(5)
    tree = PrefixTree(pool, BS)
    old = cache_chain(tree, pool, "m", list(range(12)))  # 3-block chain, released first
    new = cache_chain(tree, pool, "m", [50 + t for t in range(8)])  # 2-block chain, released later
    order = []
    for _ in range(5):
        block = pool.allocate(1)[0]
        order.append(block)
    assert order == [old[2], old[1], old[0], new[1], new[0]]
    assert tree.num_nodes == 0


def test_a_hit_block_is_not_evicted_while_other_blocks_are_free() -> None:
    pool = BlockPool(4)
    tree = PrefixTree(pool, BS)
    cached = cache_chain(tree, pool, "m", list(range(4)))
    others = pool.allocate(3)
    assert cached[0] not in others
    assert tree.match("m", list(range(5)), 4).full_blocks == cached


def test_evicting_a_leaf_can_expose_its_parent() -> None:
    pool = BlockPool(2)
    tree = PrefixTree(pool, BS)
    blocks = cache_chain(tree, pool, "m", list(range(8)))
    assert pool.allocate(1) == [blocks[1]]
    assert tree.match("m", list(range(9)), 8).full_blocks == [blocks[0]]
    assert pool.allocate(1) == [blocks[0]]
    assert tree.namespaces() == []
