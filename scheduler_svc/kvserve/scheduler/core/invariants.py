"""Whole-state consistency checks and a human-readable dump of the scheduler's KV state.

`check` verifies the KV invariants (every block free, cached or referenced; ref counts
equal the block tables holding them; cached exactly when in the prefix tree; tree chains
and LRU order; reservations; block accounting; listed in docs/architecture.md) and the
queue bookkeeping around them, in O(blocks + tokens). Tests call it after every step,
and `SchedulerConfig.debug_invariants` runs it inside the scheduler. `dump` is what to
print when one fails: every live sequence's block table with each block's ref count.
Both read only a `SchedulerView`.
"""

from __future__ import annotations

from collections import Counter

from kvserve.scheduler.core.request import WAITING_STATES, SequenceStatus
from kvserve.scheduler.core.scheduler_view import SchedulerView


class InvariantError(AssertionError):
    """A scheduler invariant does not hold; the message names it and the blocks or sequence involved."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantError(message)


def check(view: SchedulerView) -> None:
    """Raise InvariantError naming the first broken pool, ref-count, tree, queue or swap-space rule."""
    _check_pool(view)
    _check_ref_counts(view)
    _check_tree(view)
    _check_queues(view)
    _check_swap_space(view)
    _check_reservations(view)
    _check_block_counts(view)


def _check_pool(view: SchedulerView) -> None:
    pool = view.pool
    free, cached = pool.free_blocks(), pool.cached_blocks_lru()
    referenced = sum(1 for count in pool.ref_counts if count > 0)
    _require(len(free) == len(set(free)), f"a block appears twice in the free list: {sorted(free)}")
    _require(not set(free) & set(cached), f"blocks both free and cached: {sorted(set(free) & set(cached))}")
    for block in free:
        _require(
            pool.ref_counts[block] == 0 and not pool.is_cached(block),
            f"free block {block} has ref count {pool.ref_counts[block]} or is still cached",
        )
    for block in cached:
        _require(
            pool.ref_counts[block] == 0 and pool.is_cached(block),
            f"evictable block {block} has ref count {pool.ref_counts[block]} or is not in the tree",
        )
    _require(
        len(free) + len(cached) + referenced == pool.num_blocks,
        f"free {len(free)} + cached {len(cached)} + referenced {referenced} != total {pool.num_blocks}",
    )
    _require(not view.pinned, f"blocks still pinned outside schedule(): {list(view.pinned)}")


def _check_ref_counts(view: SchedulerView) -> None:
    pool = view.pool
    holders: Counter[int] = Counter()
    for seq in view.running:
        table = seq.block_table
        _require(len(table) == len(set(table)), f"seq {seq.seq_id} holds a block twice: {table}")
        holders.update(table)
    holders.update(view.loading)
    for block in range(pool.num_blocks):
        _require(
            pool.ref_counts[block] == holders[block],
            f"block {block}: ref count {pool.ref_counts[block]} but {holders[block]} block tables and loads hold it",
        )


def _check_tree(view: SchedulerView) -> None:
    pool, tree, bs = view.pool, view.tree, view.block_size
    nodes = tree.nodes()
    cached_flags = sum(1 for block in range(pool.num_blocks) if pool.is_cached(block))
    _require(cached_flags == len(nodes), f"{cached_flags} blocks marked cached but the tree has {len(nodes)} nodes")
    lru_position = {block: pos for pos, block in enumerate(pool.cached_blocks_lru())}
    for node in nodes:
        _require(pool.is_cached(node.block), f"tree node for block {node.block} but the pool has it uncached")
        _require(tree.node_of(node.block) is node, f"block {node.block} maps to another node")
        _require(tree.is_attached(node), f"tree node for block {node.block} is detached from its namespace root")
        _require(0 < len(node.key) <= bs, f"node for block {node.block} has a key of {len(node.key)} tokens")
        _require(len(node.key) == bs or not node.children, f"partial tail node for block {node.block} has children")
        parent = node.parent
        if pool.ref_counts[node.block] > 0 and parent is not None and parent.parent is not None:
            _require(
                pool.ref_counts[parent.block] > 0,
                f"block {node.block} is referenced but its parent block {parent.block} is not",
            )
        if node.block in lru_position:
            for child in node.children.values():
                _require(
                    lru_position.get(child.block, -1) < lru_position[node.block],
                    f"block {node.block} would be evicted before its child {child.block}",
                )
    for seq in view.running:
        if seq.num_tree_blocks == 0:
            _require(seq.tree_node is None, f"seq {seq.seq_id} has a tree node but no tree blocks")
            continue
        link = seq.tree_node
        for index in range(seq.num_tree_blocks - 1, -1, -1):
            if link is None or link.block != seq.block_table[index]:
                raise InvariantError(f"seq {seq.seq_id}: block {index} is not the tree chain's block")
            link = link.parent
        _require(link is not None and link.parent is None, f"seq {seq.seq_id}: tree chain does not start at a root")


def _check_queues(view: SchedulerView) -> None:
    bs = view.block_size
    queues = {SequenceStatus.RUNNING: view.running, SequenceStatus.SWAPPED: view.swapped}
    for status, queue in (*queues.items(), (SequenceStatus.WAITING, view.waiting)):
        keys = [seq.sort_key for seq in queue]
        _require(keys == sorted(keys), f"{status.value} queue is out of priority/arrival order")
    queue_of = {id(seq): status for status, queue in queues.items() for seq in queue}
    queue_of.update((id(seq), SequenceStatus.WAITING) for seq in view.waiting)
    members = set(queue_of)
    total_queued = len(view.running) + len(view.swapped) + len(view.waiting)
    _require(len(members) == total_queued, "a sequence sits in two queues (or twice in one)")
    _require(len(view.running) <= view.max_num_seqs, "more running sequences than max_num_seqs")
    live = 0
    for request_id, request in view.requests.items():
        unfinished = [seq for seq in request.seqs if not seq.is_finished]
        _require(
            request.num_unfinished == len(unfinished) > 0,
            f"request {request_id}: num_unfinished {request.num_unfinished}, actually {len(unfinished)}",
        )
        for seq in unfinished:
            live += 1
            _require(id(seq) in members, f"seq {seq.seq_id} ({seq.status.value}) is in no queue")
            expected = SequenceStatus.WAITING if seq.status in WAITING_STATES else seq.status
            _require(queue_of[id(seq)] is expected, f"seq {seq.seq_id} is {seq.status.value} but queued elsewhere")
            if seq.status is SequenceStatus.RUNNING:
                _require(seq.known, f"running seq {seq.seq_id} is unknown to the executor")
                _require(
                    seq.num_computed < len(seq.token_ids),
                    f"running seq {seq.seq_id} has computed all its {len(seq.token_ids)} tokens",
                )
                blocks = len(seq.block_table)
                reach = len(seq.token_ids) + view.inflight_drafts.get(seq.seq_id, 0)
                _require(
                    -(-seq.num_computed // bs) <= blocks <= -(-reach // bs),
                    f"running seq {seq.seq_id}: {blocks} blocks for {seq.num_computed} computed "
                    f"of {len(seq.token_ids)} tokens",
                )
            else:
                _require(not seq.block_table, f"{seq.status.value} seq {seq.seq_id} still holds device blocks")
                _require(not seq.known, f"{seq.status.value} seq {seq.seq_id} is still known to the executor")
            if seq.status in WAITING_STATES:
                _require(seq.num_computed == 0 and not seq.cpu_table, f"waiting seq {seq.seq_id} holds KV")
    _require(live == total_queued, f"{total_queued} queued sequences but {live} live ones")


def _check_swap_space(view: SchedulerView) -> None:
    cpu, bs = view.cpu, view.block_size
    free = cpu.free_blocks()
    used = [block for seq in view.swapped for block in seq.cpu_table]
    _require(len(free) == len(set(free)), "a CPU block appears twice in the CPU free list")
    _require(len(used) == len(set(used)) and not set(used) & set(free), "a CPU block is owned twice")
    _require(
        len(free) + len(used) == cpu.num_blocks,
        f"CPU blocks: free {len(free)} + swapped {len(used)} != total {cpu.num_blocks}",
    )
    for seq in view.swapped:
        _require(
            len(seq.cpu_table) == -(-seq.num_computed // bs),
            f"swapped seq {seq.seq_id}: {len(seq.cpu_table)} CPU blocks for {seq.num_computed} tokens",
        )


def _check_reservations(view: SchedulerView) -> None:
    """The pool holds back exactly what running sequences may still grow into, and can honour it."""
    pool, config = view.pool, view.config
    _require(
        0 <= pool.num_reserved <= pool.num_free + pool.num_cached,
        f"{pool.num_reserved} blocks reserved but only {pool.num_free + pool.num_cached} are free or cached",
    )
    held = 0
    for request_id, request in view.requests.items():
        expected = config.reserved_blocks(len(request.prompt_token_ids), request.sampling.max_tokens)
        _require(
            request.reserve_blocks == expected,
            f"request {request_id} reserves {request.reserve_blocks} blocks, "
            f"kv_reservation={config.kv_reservation} says {expected}",
        )
        for seq in request.seqs:
            if seq.status is not SequenceStatus.RUNNING:
                _require(seq.reserved_blocks == 0, f"{seq.status.value} seq {seq.seq_id} still holds a reservation")
                continue
            held += seq.reserved_blocks
            reach = len(seq.block_table) + seq.reserved_blocks
            _require(
                reach == request.reserve_blocks if request.reserve_blocks else seq.reserved_blocks == 0,
                f"running seq {seq.seq_id}: {len(seq.block_table)} blocks + {seq.reserved_blocks} reserved "
                f"!= its reservation of {request.reserve_blocks}",
            )
    _require(held == pool.num_reserved, f"sequences hold {held} reserved blocks, the pool {pool.num_reserved}")


def _check_block_counts(view: SchedulerView) -> None:
    """Every reference taken is held or given back: per request, and for the pool as a whole."""
    pool = view.pool
    outstanding = pool.num_allocated_total + pool.num_shared_total - pool.num_released_total
    _require(
        outstanding == sum(pool.ref_counts),
        f"pool counters: allocated {pool.num_allocated_total} + shared {pool.num_shared_total} - released "
        f"{pool.num_released_total} != {sum(pool.ref_counts)} references held",
    )
    for request_id, request in view.requests.items():
        counts = request.blocks
        held = sum(len(seq.block_table) for seq in request.seqs)
        _require(
            min(counts.hit, counts.allocated, counts.copied, counts.freed) >= 0 and counts.copied <= counts.hit,
            f"request {request_id}: negative block counts or more copies than hits: {counts}",
        )
        _require(
            counts.allocated + counts.hit - counts.copied - counts.freed == held,
            f"request {request_id}: allocated {counts.allocated} + hit {counts.hit} - copied {counts.copied} "
            f"- freed {counts.freed} != {held} blocks its tables hold",
        )


def dump(view: SchedulerView) -> str:
    """Step ids, pool/CPU/tree figures, then every request's sequences with their block tables."""
    pool, tree = view.pool, view.tree
    refs = pool.ref_counts
    lines = [
        f"step {view.step_id}  in flight: {view.inflight_step_id}",
        f"blocks: total {pool.num_blocks}  free {pool.num_free}  cached {pool.num_cached}  "
        f"referenced {pool.num_referenced}  tree nodes {tree.num_nodes} in {len(tree.namespaces())} namespaces",
        f"reserved {pool.num_reserved} ({view.config.kv_reservation})  allocated total {pool.num_allocated_total}  "
        f"shared total {pool.num_shared_total}  released total {pool.num_released_total}",
        f"cpu blocks: total {view.cpu.num_blocks}  free {view.cpu.num_free}",
        f"pending drops: {list(view.pending_drops)}",
    ]
    for request in view.requests.values():
        lines.append(
            f"request {request.request_id!r} prio={request.priority} ns={request.namespace!r} "
            f"prompt={len(request.prompt_token_ids)} n={len(request.seqs)}"
        )
        for seq in request.seqs:
            table = " ".join(
                f"{block}(rc={refs[block]}{',tree' if pool.is_cached(block) else ''})" for block in seq.block_table
            )
            lines.append(
                f"  seq {seq.seq_id} #{seq.index} {seq.status.value:9} computed {seq.num_computed}/"
                f"{len(seq.token_ids)} tree_blocks {seq.num_tree_blocks}"
                f"{' frozen' if seq.cache_frozen else ''}"
                f"{f' reserved {seq.reserved_blocks}' if seq.reserved_blocks else ''}  blocks [{table}]"
                + (f"  cpu {seq.cpu_table}" if seq.cpu_table else "")
            )
    lines.append(f"evictable (LRU first): {pool.cached_blocks_lru()}")
    return "\n".join(lines)
