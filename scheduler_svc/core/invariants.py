"""Whole-state consistency checks and a human-readable dump of the scheduler's KV state.

`check` verifies DESIGN §2's invariants (and the queue bookkeeping around them) in
O(blocks + tokens); tests call it after every step, and `SchedulerConfig.debug_invariants`
runs it inside the scheduler. `dump` is what to print when one fails: every live
sequence's block table with each block's ref count.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from scheduler_svc.core.request import WAITING_STATES, SequenceStatus

if TYPE_CHECKING:
    from scheduler_svc.core.scheduler import Scheduler


class InvariantError(AssertionError):
    """A scheduler invariant does not hold; the message names it and the blocks or sequence involved."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantError(message)


def check(sched: Scheduler) -> None:
    _check_pool(sched)
    _check_ref_counts(sched)
    _check_tree(sched)
    _check_queues(sched)
    _check_swap_space(sched)


def _check_pool(sched: Scheduler) -> None:
    pool = sched._kv.pool
    free, cached = pool.free_blocks(), pool.cached_blocks_lru()
    referenced = sum(1 for count in pool.ref_counts if count > 0)
    _require(len(free) == len(set(free)), f"a block appears twice in the free list: {sorted(free)}")
    _require(not set(free) & set(cached), f"blocks both free and cached: {sorted(set(free) & set(cached))}")
    for block in free:
        _require(pool.ref_counts[block] == 0 and not pool.is_cached(block),
                 f"free block {block} has ref count {pool.ref_counts[block]} or is still cached")
    for block in cached:
        _require(pool.ref_counts[block] == 0 and pool.is_cached(block),
                 f"evictable block {block} has ref count {pool.ref_counts[block]} or is not in the tree")
    _require(len(free) + len(cached) + referenced == pool.num_blocks,
             f"free {len(free)} + cached {len(cached)} + referenced {referenced} != total {pool.num_blocks}")
    _require(not sched._kv.pinned, f"blocks still pinned outside schedule(): {sched._kv.pinned}")


def _check_ref_counts(sched: Scheduler) -> None:
    pool = sched._kv.pool
    holders: Counter[int] = Counter()
    for seq in sched._running:
        table = seq.block_table
        _require(len(table) == len(set(table)), f"seq {seq.seq_id} holds a block twice: {table}")
        holders.update(table)
    for block in range(pool.num_blocks):
        _require(pool.ref_counts[block] == holders[block],
                 f"block {block}: ref count {pool.ref_counts[block]} but {holders[block]} live block tables hold it")


def _check_tree(sched: Scheduler) -> None:
    pool, tree, bs = sched._kv.pool, sched._kv.tree, sched._bs
    nodes = tree.nodes()
    cached_flags = sum(1 for block in range(pool.num_blocks) if pool.is_cached(block))
    _require(cached_flags == len(nodes), f"{cached_flags} blocks marked cached but the tree has {len(nodes)} nodes")
    lru_position = {block: pos for pos, block in enumerate(pool.cached_blocks_lru())}
    for node in nodes:
        _require(pool.is_cached(node.block), f"tree node for block {node.block} but the pool has it uncached")
        _require(tree.node_of(node.block) is node, f"block {node.block} maps to another node")
        _require(tree.is_attached(node), f"tree node for block {node.block} is detached from its namespace root")
        _require(0 < len(node.key) <= bs, f"node for block {node.block} has a key of {len(node.key)} tokens")
        _require(len(node.key) == bs or not node.children,
                 f"partial tail node for block {node.block} has children")
        parent = node.parent
        if pool.ref_counts[node.block] > 0 and parent is not None and parent.parent is not None:
            _require(pool.ref_counts[parent.block] > 0,
                     f"block {node.block} is referenced but its parent block {parent.block} is not")
        if node.block in lru_position:
            for child in node.children.values():
                _require(lru_position.get(child.block, -1) < lru_position[node.block],
                         f"block {node.block} would be evicted before its child {child.block}")
    for seq in sched._running:
        if seq.num_tree_blocks == 0:
            _require(seq.tree_node is None, f"seq {seq.seq_id} has a tree node but no tree blocks")
            continue
        node = seq.tree_node
        for index in range(seq.num_tree_blocks - 1, -1, -1):
            _require(node is not None and node.block == seq.block_table[index],
                     f"seq {seq.seq_id}: block {index} is not the tree chain's block")
            node = node.parent
        _require(node is not None and node.parent is None, f"seq {seq.seq_id}: tree chain does not start at a root")


def _check_queues(sched: Scheduler) -> None:
    bs = sched._bs
    queues = {SequenceStatus.RUNNING: sched._running, SequenceStatus.SWAPPED: sched._swapped}
    for status, queue in (*queues.items(), (SequenceStatus.WAITING, sched._waiting)):
        keys = [seq.sort_key for seq in queue]
        _require(keys == sorted(keys), f"{status.value} queue is out of priority/arrival order")
    queue_of = {id(seq): status for status, queue in queues.items() for seq in queue}
    queue_of.update((id(seq), SequenceStatus.WAITING) for seq in sched._waiting)
    members = set(queue_of)
    total_queued = len(sched._running) + len(sched._swapped) + len(sched._waiting)
    _require(len(members) == total_queued, "a sequence sits in two queues (or twice in one)")
    _require(len(sched._running) <= sched.config.max_num_seqs, "more running sequences than max_num_seqs")
    live = 0
    for request_id, request in sched._requests.items():
        unfinished = [seq for seq in request.seqs if not seq.is_finished]
        _require(request.num_unfinished == len(unfinished) > 0,
                 f"request {request_id}: num_unfinished {request.num_unfinished}, actually {len(unfinished)}")
        for seq in unfinished:
            live += 1
            _require(id(seq) in members, f"seq {seq.seq_id} ({seq.status.value}) is in no queue")
            expected = SequenceStatus.WAITING if seq.status in WAITING_STATES else seq.status
            _require(queue_of[id(seq)] is expected, f"seq {seq.seq_id} is {seq.status.value} but queued elsewhere")
            if seq.status is SequenceStatus.RUNNING:
                _require(seq.known, f"running seq {seq.seq_id} is unknown to the executor")
                _require(seq.num_computed < len(seq.token_ids),
                         f"running seq {seq.seq_id} has computed all its {len(seq.token_ids)} tokens")
                blocks = len(seq.block_table)
                _require(-(-seq.num_computed // bs) <= blocks <= -(-len(seq.token_ids) // bs),
                         f"running seq {seq.seq_id}: {blocks} blocks for {seq.num_computed} computed "
                         f"of {len(seq.token_ids)} tokens")
            else:
                _require(not seq.block_table, f"{seq.status.value} seq {seq.seq_id} still holds device blocks")
                _require(not seq.known, f"{seq.status.value} seq {seq.seq_id} is still known to the executor")
            if seq.status in WAITING_STATES:
                _require(seq.num_computed == 0 and not seq.cpu_table, f"waiting seq {seq.seq_id} holds KV")
    _require(live == total_queued, f"{total_queued} queued sequences but {live} live ones")


def _check_swap_space(sched: Scheduler) -> None:
    cpu, bs = sched._kv.cpu, sched._bs
    free = cpu.free_blocks()
    used = [block for seq in sched._swapped for block in seq.cpu_table]
    _require(len(free) == len(set(free)), "a CPU block appears twice in the CPU free list")
    _require(len(used) == len(set(used)) and not set(used) & set(free), "a CPU block is owned twice")
    _require(len(free) + len(used) == cpu.num_blocks,
             f"CPU blocks: free {len(free)} + swapped {len(used)} != total {cpu.num_blocks}")
    for seq in sched._swapped:
        _require(len(seq.cpu_table) == -(-seq.num_computed // bs),
                 f"swapped seq {seq.seq_id}: {len(seq.cpu_table)} CPU blocks for {seq.num_computed} tokens")


def dump(sched: Scheduler) -> str:
    pool, tree = sched._kv.pool, sched._kv.tree
    refs = pool.ref_counts
    lines = [
        f"step {sched._step_id}  in flight: {sched._inflight.step_id if sched._inflight else None}",
        f"blocks: total {pool.num_blocks}  free {pool.num_free}  cached {pool.num_cached}  "
        f"referenced {pool.num_referenced}  tree nodes {tree.num_nodes} in {len(tree.namespaces())} namespaces",
        f"cpu blocks: total {sched._kv.cpu.num_blocks}  free {sched._kv.cpu.num_free}",
        f"pending drops: {sched._pending_drops}",
    ]
    for request in sched._requests.values():
        lines.append(f"request {request.request_id!r} prio={request.priority} ns={request.namespace!r} "
                     f"prompt={len(request.prompt_token_ids)} n={len(request.seqs)}")
        for seq in request.seqs:
            table = " ".join(f"{block}(rc={refs[block]}{',tree' if pool.is_cached(block) else ''})"
                             for block in seq.block_table)
            lines.append(f"  seq {seq.seq_id} #{seq.index} {seq.status.value:9} computed {seq.num_computed}/"
                         f"{len(seq.token_ids)} tree_blocks {seq.num_tree_blocks}"
                         f"{' frozen' if seq.cache_frozen else ''}  blocks [{table}]"
                         + (f"  cpu {seq.cpu_table}" if seq.cpu_table else ""))
    lines.append(f"evictable (LRU first): {pool.cached_blocks_lru()}")
    return "\n".join(lines)
