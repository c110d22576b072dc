"""The prefix cache's tiers below the pool as the scheduler keeps them: which blocks they hold, the
loads in flight and the stores to send.

**Tiers.** The executor has host memory (`--kv-host-gb`), a disk directory (`--kv-disk-dir`) or
both (`ExecutorInfo.kv_tiers`); the scheduler plans the same stores and loads for any of them. Host
memory is read first, and each load's result says which tier served it (`StepResult.disk_load_blocks`),
which the request's usage and the counters split by. The keys a tier lets go of come back in
`StepResult.dropped_keys`, so no load is planned that would miss.

**Keys.** A block's key chains its parent's key and its tokens (the KV events' `block_hash`), from a
seed of the executor's fingerprint (weights, dtype, weight format, layout, block size:
`ExecutorInfo.kv_fingerprint`) and the prefix namespace (model, tenant, `cache_salt`). The same
tokens under another model, tenant or salt get another key, so a file written for one is never a
hit for the other; a file is named by its key, and the executor checks the fingerprint in its
header too. Requests under a LoRA adapter stay off the disk: an adapter's name and id do not
identify its weights across restarts.

**Stores** are write-through: each full block the tree caches (`note_cached`) goes to disk in the
next plan, before that plan may reuse the block, unless its key is already there. So the disk tier
holds what the pool evicted, and survives an executor's or the whole server's restart.

**Loads** run one step ahead of the request that needs them (`start_loads`): the blocks are read
into freshly allocated device blocks, the request waits that step, and the blocks join the tree
only once the result says they loaded (`finish_loads`). A missing or corrupt file then costs only
its recomputation: nothing ever read the block. Until then the loader holds a reference on every
block of the chain (the matched ones and the loading ones), so eviction cannot take them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvserve.protos.kv_events import MEDIUM_CPU, MEDIUM_DISK, block_hash
from kvserve.protos.step import StepPlan
from kvserve.scheduler.core.block_pool import BlockPool
from kvserve.scheduler.core.outputs import DiskTierStats
from kvserve.scheduler.core.prefix_tree import PrefixNode, PrefixTree, PrefixTreeListener
from kvserve.scheduler.core.request import Request


def disk_scope(fingerprint: str, namespace: str) -> str:
    """What a namespace's first block key is seeded with: the executor's fingerprint and the namespace."""
    return f"{fingerprint}\0{namespace}"


@dataclass(slots=True)
class LoadChain:
    """One request's run of blocks being loaded, in chain order under `parent` (None: the root)."""

    namespace: str
    request: Request
    """The request the loads are for: its usage counts the tokens loaded, by tier."""
    parent: PrefixNode | None
    held: list[int]
    """The matched blocks before the run, referenced until the loads are done."""
    blocks: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    """(device block, key, tokens) of each block loading."""


class DiskTier:
    """The keys the tiers below the pool hold, the stores the next plan sends, and the loads in flight."""

    def __init__(
        self,
        fingerprint: str,
        keys: Iterable[int],
        block_size: int,
        media: Iterable[str] = (MEDIUM_DISK,),
        block_bytes: int = 0,
    ) -> None:
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.media = tuple(media)
        self.block_bytes = block_bytes
        self.on_disk: set[int] = set(keys)
        """The keys some tier below the pool holds (the disk's at the handshake, then every store)."""
        self.medium = MEDIUM_DISK if MEDIUM_DISK in self.media else MEDIUM_CPU
        """The medium the KV events name for the tiers' blocks: the disk's when there is one (every block
        is written through to it), else host memory's."""
        self.listener: PrefixTreeListener | None = None
        """Told of the blocks the tiers gain and lose (the tree's listener: KV events)."""
        self._stores: list[tuple[int, int]] = []
        self._chains: list[LoadChain] = []
        self._loading: set[int] = set()
        self.loaded_blocks = 0
        """Loaded from disk."""
        self.host_loaded_blocks = 0
        self.failed_loads = 0
        self.stored_blocks = 0

    def carry_counters(self, old: DiskTier) -> None:
        """Keep `old`'s totals (this tier replaces it after an executor reset)."""
        self.loaded_blocks, self.host_loaded_blocks, self.failed_loads, self.stored_blocks = (
            old.loaded_blocks,
            old.host_loaded_blocks,
            old.failed_loads,
            old.stored_blocks,
        )

    def stats(self) -> DiskTierStats:
        return DiskTierStats(
            len(self.on_disk),
            self.loaded_blocks,
            self.failed_loads,
            self.stored_blocks,
            self.host_loaded_blocks,
            self.block_bytes,
            self.media,
        )

    def drop_keys(self, keys: Iterable[int]) -> None:
        """Keys no tier holds any more (`StepResult.dropped_keys`): no load of them is planned again."""
        gone = [key for key in keys if key in self.on_disk]
        self.on_disk.difference_update(gone)
        if gone and self.listener is not None:
            self.listener.dropped_below(gone, self.medium)

    def scope(self, namespace: str) -> str:
        return disk_scope(self.fingerprint, namespace)

    def key_of(self, node: PrefixNode | None) -> int | None:
        """The key of a tree node's block (its chain from the namespace's root); None for the root."""
        if node is None or node.parent is None:
            return None
        if node.disk_key == 0:
            node.disk_key = block_hash(self.key_of(node.parent), self.scope(node.namespace), node.key)
        return node.disk_key

    # --- stores ------------------------------------------------------------------------------

    def note_cached(self, node: PrefixNode) -> None:
        """A full block just joined the tree: store it unless its key is on disk already."""
        key = self.key_of(node)
        assert key is not None  # a cached block is never a root
        if key not in self.on_disk:
            self.on_disk.add(key)
            self._stores.append((node.block, key))
            self.stored_blocks += 1
            if self.listener is not None:
                self.listener.stored_below(node, key, self.medium)

    @property
    def has_stores(self) -> bool:
        """Stores noted and not yet sent: the last request's blocks must reach the disk too."""
        return bool(self._stores)

    def take_stores(self, plan: StepPlan) -> None:
        """Put the stores noted since the last plan into `plan`."""
        if self._stores:
            plan.store_blocks, self._stores = self._stores, []

    # --- loads -------------------------------------------------------------------------------

    def start_loads(
        self, tree: PrefixTree, pool: BlockPool, request: Request, token_ids: list[int], plan: StepPlan
    ) -> bool:
        """Load the blocks of `token_ids` that follow its cached prefix and a tier holds; True when the
        sequence must wait a step for them (loads started now, or another request's in flight)."""
        bs = self.block_size
        namespace = request.namespace
        limit = len(token_ids) - 1  # as admission: one token is always left to compute
        match = tree.match(namespace, token_ids, limit, count=False)
        start = len(match.full_blocks) * bs
        key = self.key_of(match.node)
        scope = self.scope(namespace)
        wanted: list[tuple[int, tuple[int, ...]]] = []
        for pos in range(start, limit - bs + 1, bs):
            tokens = tuple(token_ids[pos : pos + bs])
            key = block_hash(key, scope, tokens)
            if key in self._loading:
                return True  # the blocks come with another request's loads: match them next step
            if key not in self.on_disk:
                break
            wanted.append((key, tokens))
        if not wanted:
            return False
        held = list(match.full_blocks)
        for block in held:
            pool.ref(block)  # the chain stays attached while the loads run
        count = min(len(wanted), pool.num_allocatable)
        blocks = pool.allocate(count) if count else None
        if blocks is None:
            pool.release_table(held)
            return False
        chain = LoadChain(namespace, request, match.node, held)
        for block, (key, tokens) in zip(blocks, wanted, strict=False):
            chain.blocks.append((block, key, tokens))
            plan.load_blocks.append((block, key))
            self._loading.add(key)
        self._chains.append(chain)
        return True

    def finish_loads(
        self, tree: PrefixTree, pool: BlockPool, failed: Iterable[int], from_disk: Iterable[int] = ()
    ) -> None:
        """The plan's loads are done: the blocks that loaded join the tree as cached blocks, in chain
        order; a failed one (and what follows it) goes back to the pool and its key out of the tiers.
        `from_disk`: the blocks the disk served (host memory served the others)."""
        failed_blocks = set(failed)
        disk_blocks = set(from_disk)
        for chain in self._chains:
            parent = chain.parent
            broken = False
            for block, key, tokens in chain.blocks:
                self._loading.discard(key)
                if broken or block in failed_blocks:
                    if not broken:
                        self.drop_keys((key,))
                        self.failed_loads += 1
                    broken = True
                    continue
                node = tree.insert(chain.namespace, parent, tokens, block)
                if node is None:  # computed meanwhile into another block: keep that one
                    parent = (parent or tree.root(chain.namespace)).children[tokens]
                else:
                    node.disk_key = key
                    parent = node
                    if block in disk_blocks:
                        self.loaded_blocks += 1
                        chain.request.num_disk_cached_tokens += len(tokens)
                    else:
                        self.host_loaded_blocks += 1
                        chain.request.num_host_cached_tokens += len(tokens)
            # Tail first, as a block table is released: a chain's tail is evicted before its parents.
            pool.release_table([*chain.held, *(block for block, _, _ in chain.blocks)])
        self._chains.clear()

    def referenced_blocks(self) -> tuple[int, ...]:
        """Every block the loads in flight hold a reference on (for the invariant checks)."""
        return tuple(b for chain in self._chains for b in (*chain.held, *(block for block, _, _ in chain.blocks)))

    def drop_in_flight(self) -> None:
        """The executor was lost: forget the loads without touching the old pool, and the stores not sent
        (their blocks died with it, so their keys are not on disk after all)."""
        self._chains.clear()
        self._loading.clear()
        self.drop_keys([key for _, key in self._stores])
        self.stored_blocks -= len(self._stores)
        self._stores.clear()
