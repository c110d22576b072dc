"""The scheduler's KV memory: block pool, prefix tree, CPU swap space and every block table.

The `Scheduler` decides *who* runs; this class decides *which blocks* they use and writes
the block ops (copy, swap-out, swap-in) into the plan. Rules it keeps (the KV memory
section of docs/architecture.md):

- a sequence's block table starts with the blocks of its tree chain (shared, never
  written again), followed by private blocks; only private blocks are written;
- a block enters the tree only once its tokens are computed (confirmed by a StepResult),
  so a prefix hit never reads KV that the same step is still writing;
- a block that a plan reads (a copy source) stays pinned until the plan is built, so no
  allocation in the same plan can hand it out;
- under a `kv_reservation` policy a running sequence's table can always grow to
  `request.reserve_blocks`: the pool holds back `seq.reserved_blocks` for it.

It also bumps each request's `BlockCounts` where it shares, allocates, copies and drops blocks.
"""

from __future__ import annotations

from kvserve.protos.step import StepPlan
from kvserve.scheduler.core import admission
from kvserve.scheduler.core.block_pool import BlockPool, CpuBlockPool
from kvserve.scheduler.core.disk_tier import DiskTier
from kvserve.scheduler.core.prefix_tree import PrefixMatch, PrefixTree
from kvserve.scheduler.core.request import Sequence


class KvManager:
    """Which blocks each sequence uses: allocation, prefix reuse, tree inserts and swap, per plan."""

    __slots__ = ("_pinned", "block_size", "caching", "cpu", "disk", "pool", "tree")

    def __init__(
        self, num_blocks: int, block_size: int, num_cpu_blocks: int, caching: bool, previous: KvManager | None = None
    ) -> None:
        """`previous` carries the prefix-cache counters and the tree's listener across an executor reset."""
        self.block_size = block_size
        self.caching = caching
        self.pool = BlockPool(num_blocks)
        self.tree = PrefixTree(self.pool, block_size)
        self.cpu = CpuBlockPool(num_cpu_blocks)
        self._pinned: list[int] = []
        self.disk: DiskTier | None = None
        """The prefix cache's disk tier, when the executor has one (`Scheduler.set_disk_tier`)."""
        if previous is not None:
            self.tree.queried_tokens = previous.tree.queried_tokens
            self.tree.hit_tokens = previous.tree.hit_tokens
            self.tree.listener = previous.tree.listener
            if self.tree.listener is not None:
                self.tree.listener.cleared()  # the old tree's blocks died with the old pool

    @property
    def pinned(self) -> tuple[int, ...]:
        """Copy sources pinned for the plan being built (empty once `unpin()` ran)."""
        return tuple(self._pinned)

    # --- admission -------------------------------------------------------------------

    def find_prefix(self, seq: Sequence, step_id: int) -> tuple[PrefixMatch, bool]:
        """Where a waiting sequence's KV can come from: (match, whether it forks from completion 0)."""
        fork = admission.fork_match(seq, self.block_size, step_id)
        if fork is not None:
            return fork, True
        if self.caching:
            return self.tree.match(seq.request.namespace, seq.token_ids, len(seq.token_ids) - 1), False
        return PrefixMatch(), False

    def admit(self, seq: Sequence, match: PrefixMatch, forked: bool, budget: int, plan: StepPlan) -> int:
        """Give `seq` its block table if the pool can hold all its known tokens; return tokens to schedule.

        Under a `kv_reservation` policy the pool must hold the whole reservation instead, and
        what is not allocated now is reserved for the sequence until it ends. Returns 0 (and
        changes nothing) when there is no room.
        """
        pool, bs = self.pool, self.block_size
        num_tokens = len(seq.token_ids)
        full = match.full_blocks
        refs = pool.ref_counts
        request = seq.request
        revived = sum(1 for block in full if refs[block] == 0)  # cached blocks about to be referenced
        # The blocks this table must be able to reach: its known tokens' or, reserving, the reservation's.
        total_new = max(-(-num_tokens // bs), request.reserve_blocks) - len(full)
        room = pool.num_allocatable - revived
        if match.partial_block is not None and total_new + (refs[match.partial_block] == 0) > room:
            match.num_tokens -= match.partial_slots  # no room to pin the copy source: recompute those slots
            match.partial_block, match.partial_slots = None, 0
        if total_new > room:
            return 0
        computed = match.num_tokens
        count = min(num_tokens - computed, budget)
        for block in full:
            pool.ref(block)
        source = match.partial_block
        if source is not None:
            pool.ref(source)  # pinned until the plan is built, so no allocation below can reuse it
            self._pinned.append(source)
        new_blocks = pool.allocate((computed + count + bs - 1) // bs - len(full))
        assert new_blocks is not None, "admission checked the room"
        counts = request.blocks
        counts.hit += len(full)
        counts.allocated += len(new_blocks)
        if source is not None:
            plan.copies.append((source, new_blocks[0]))
            counts.hit += 1
            counts.copied += 1
        if request.reserve_blocks:
            seq.reserved_blocks = total_new - len(new_blocks)
            pool.reserve(seq.reserved_blocks)
        seq.block_table = full + new_blocks
        seq.num_computed = computed
        admission.place_in_tree(seq, match, forked, self.caching)
        return count

    def unpin(self) -> None:
        """The plan is complete: copy sources may be reused by later plans."""
        for block in self._pinned:
            self.pool.release(block)
        self._pinned.clear()

    # --- growth and release ----------------------------------------------------------

    def allocate(self, seq: Sequence, need: int) -> list[int] | None:
        """`need` fresh blocks for `seq` to grow into, out of its reservation if it has one; None: nothing changed."""
        pool = self.pool
        reserved = seq.reserved_blocks
        if reserved:
            take = need if need < reserved else reserved
            pool.num_reserved -= take  # its own reservation becomes allocatable to it, and only to it
            blocks = pool.allocate(need)
            if blocks is None:
                pool.num_reserved += take
                return None
            seq.reserved_blocks = reserved - take
        elif need == 1:
            block = pool.allocate_one()
            if block is None:
                return None
            blocks = [block]
        else:
            blocks = pool.allocate(need)
            if blocks is None:
                return None
        seq.request.blocks.allocated += need
        return blocks

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Add the sequence's newly computed full blocks to the tree, so others hit them while it runs."""
        bs = self.block_size
        tokens, table, node = seq.token_ids, seq.block_table, seq.tree_node
        namespace = seq.request.namespace
        for index in range(seq.num_tree_blocks, seq.num_computed // bs):
            child = self.tree.insert(namespace, node, tuple(tokens[index * bs : (index + 1) * bs]), table[index])
            if child is None:  # same tokens already cached in another block: this chain stays private
                seq.cache_frozen = True
                break
            if self.disk is not None and not seq.request.lora_name:
                self.disk.note_cached(child)
            node = child
            seq.num_tree_blocks = index + 1
        seq.tree_node = node

    def release(self, seq: Sequence) -> None:
        """Return the block table (and any reservation) to the pool, first caching the computed part of its tail."""
        if seq.reserved_blocks:
            self.pool.unreserve(seq.reserved_blocks)
            seq.reserved_blocks = 0
        table = seq.block_table
        if not table:
            return
        if self.caching and not seq.cache_frozen:
            full, tail = divmod(seq.num_computed, self.block_size)
            if tail and seq.num_tree_blocks == full and full < len(table):
                key = tuple(seq.token_ids[full * self.block_size : seq.num_computed])
                self.tree.insert(seq.request.namespace, seq.tree_node, key, table[full])
        self.pool.release_table(table)
        seq.request.blocks.freed += len(table)
        seq.block_table = []

    def forget(self, seq: Sequence) -> None:
        """Recompute-preemption: drop every block and the tree position; generated tokens stay."""
        self.release(seq)
        seq.num_computed = 0
        seq.tree_node, seq.num_tree_blocks, seq.cache_frozen = None, 0, False

    # --- swap ------------------------------------------------------------------------

    def swap_out(self, seq: Sequence, plan: StepPlan) -> bool:
        """Move the sequence's computed KV to CPU swap space; False if the space is short."""
        used = -(-seq.num_computed // self.block_size)
        cpu_blocks = self.cpu.allocate(used)
        if cpu_blocks is None:
            return False
        plan.swap_out.extend(zip(seq.block_table[:used], cpu_blocks))
        seq.cpu_table = cpu_blocks
        if seq.reserved_blocks:
            self.pool.unreserve(seq.reserved_blocks)
            seq.reserved_blocks = 0
        self.pool.release_table(seq.block_table)
        seq.request.blocks.freed += len(seq.block_table)
        seq.block_table = []
        # Swapped-in blocks will be private copies, not the tree's: the chain ends here.
        seq.tree_node, seq.num_tree_blocks, seq.cache_frozen = None, 0, True
        return True

    def swap_in(self, seq: Sequence, count: int, plan: StepPlan) -> bool:
        """Bring a swapped sequence back with room for `count` more tokens (and its reservation); False if short."""
        pool = self.pool
        need = -(-(seq.num_computed + count) // self.block_size)
        reserve = max(seq.request.reserve_blocks - need, 0)
        if need + reserve > pool.num_allocatable:
            return False
        blocks = pool.allocate(need)
        assert blocks is not None, "swap-in checked the room"
        if reserve:
            pool.reserve(reserve)
            seq.reserved_blocks = reserve
        seq.request.blocks.allocated += need
        plan.swap_in.extend(zip(seq.cpu_table, blocks))
        self.cpu.release(seq.cpu_table)
        seq.cpu_table = []
        seq.block_table = blocks
        return True

    def release_swapped(self, seq: Sequence) -> None:
        self.cpu.release(seq.cpu_table)
        seq.cpu_table = []
