"""Admission helpers: whether a request can ever fit, where a new sequence's KV comes from, and in which
order waiting ones go.

A waiting sequence reuses KV from one of two places:

- **fork** (n > 1): completion i > 0 waits until completion 0 has computed the prompt,
  then shares its full prompt blocks (ref count) and copies the block holding the last
  prompt token (copy-on-write), computing only that last token itself;
- **prefix tree**: the longest cached prefix, token-granular (see `PrefixTree.match`).
"""

from __future__ import annotations

from kvserve.protos.sampling import SamplingParams
from kvserve.scheduler.core.prefix_tree import PrefixMatch, PrefixTree
from kvserve.scheduler.core.request import RequestRejected, Sequence, SequenceStatus
from kvserve.scheduler.core.scheduler_config import SchedulerConfig


def check_fits(config: SchedulerConfig, num_blocks: int, prompt_len: int, sampling: SamplingParams) -> None:
    """Raise RequestRejected naming "prompt" or "max_tokens" if the request can never fit a pool of `num_blocks`.

    Everything else can: once every sequence behind it is preempted, the highest-priority one
    runs, so refusing these at admission is what keeps the scheduler from deadlocking."""
    if prompt_len >= config.max_model_len:
        raise RequestRejected(
            "prompt", f"{prompt_len} tokens leave no room for output within max_model_len={config.max_model_len}"
        )
    total = prompt_len + sampling.max_tokens
    if total > config.max_model_len:
        raise RequestRejected(
            "max_tokens",
            f"prompt ({prompt_len} tokens) + max_tokens ({sampling.max_tokens}) exceeds "
            f"max_model_len={config.max_model_len}",
        )
    # The last sampled token is never computed, so the KV holds at most total - 1 tokens.
    blocks = -(-(total - 1) // config.block_size)
    if blocks > num_blocks:
        raise RequestRejected(
            "max_tokens",
            f"prompt + max_tokens ({total} tokens) needs {blocks} KV blocks but the cache holds only {num_blocks}",
        )
    reserved = config.reserved_blocks(prompt_len, sampling.max_tokens)
    if reserved > num_blocks:
        raise RequestRejected(
            "max_tokens",
            f"kv_reservation={config.kv_reservation} reserves {reserved} KV blocks per sequence "
            f"but the cache holds only {num_blocks}",
        )


def fork_match(seq: Sequence, block_size: int, step_id: int) -> PrefixMatch | None:
    """Reuse completion 0's prompt KV for completion `seq.index` > 0, or None if it cannot be forked now."""
    if seq.index == 0 or len(seq.token_ids) != seq.prompt_len:
        return None  # completion 0 itself, or a resumed completion with outputs of its own
    parent = seq.request.seqs[0]
    if (
        parent.status is not SequenceStatus.RUNNING
        or parent.num_computed < seq.prompt_len
        or parent.started_step == step_id
    ):
        # A parent (re)started in this very plan may still be filling its blocks by copy or swap-in.
        return None
    full, slots = divmod(seq.prompt_len - 1, block_size)
    table = parent.block_table
    return PrefixMatch(seq.prompt_len - 1, table[:full], None, table[full] if slots else None, slots)


def place_in_tree(seq: Sequence, match: PrefixMatch, forked: bool, caching: bool) -> None:
    """Set where `seq`'s future full blocks attach in the tree after admission with `match`."""
    num_shared = len(match.full_blocks)
    if not caching:
        seq.tree_node, seq.num_tree_blocks, seq.cache_frozen = None, 0, True
        return
    if not forked:
        seq.tree_node, seq.num_tree_blocks, seq.cache_frozen = match.node, num_shared, False
        return
    parent = seq.request.seqs[0]
    if parent.num_tree_blocks >= num_shared:
        node = None
        if num_shared:
            assert parent.tree_node is not None  # its chain holds num_tree_blocks >= 1 blocks
            node = parent.tree_node.ancestor(parent.num_tree_blocks - num_shared)
        seq.tree_node, seq.num_tree_blocks, seq.cache_frozen = node, num_shared, False
    else:  # the parent's shared blocks are not all in the tree: keep the child's chain private
        seq.tree_node, seq.num_tree_blocks, seq.cache_frozen = None, 0, True


def admission_order(waiting: list[Sequence], tree: PrefixTree, config: SchedulerConfig) -> list[Sequence]:
    """Cache-aware order: within a priority, longest prefix hit first, over a bounded window.

    A sequence overtaken `cache_aware_max_skips` times goes first within its priority
    (the starvation bound); beyond the window the queue stays FCFS.
    """
    window = waiting[: config.cache_aware_window]
    max_skips = config.cache_aware_max_skips

    def rank(seq: Sequence) -> tuple:
        starving = seq.skips >= max_skips
        hit = (
            0
            if starving
            else tree.match(seq.request.namespace, seq.token_ids, len(seq.token_ids) - 1, count=False).num_tokens
        )
        return (seq.sort_key[0], not starving, -hit, seq.sort_key)

    return sorted(window, key=rank) + waiting[config.cache_aware_window :]


def count_skips(ranked: list[Sequence], admitted: list[Sequence], window: int) -> None:
    """Charge one skip to each still-waiting sequence that a later one of its priority overtook."""
    for seq in ranked[:window]:
        if seq.status is SequenceStatus.RUNNING:
            continue
        key = seq.sort_key
        if any(other.sort_key[0] == key[0] and other.sort_key > key for other in admitted):
            seq.skips += 1
