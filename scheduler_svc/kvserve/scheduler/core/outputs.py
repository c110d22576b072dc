"""What the scheduler hands back to the API layer: per-sequence output events and stats."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.protos.step import TokenLogprob
from kvserve.protos.stop_rules import FinishReason


@dataclass(slots=True)
class SampledLogprob:
    token_id: int
    logprob: float
    top: list[TokenLogprob]


@dataclass(slots=True)
class BlockCounts:
    """One request's KV block accounting over its life, summed over its n sequences.

    `KvManager` bumps these where it takes, copies and drops blocks. Every reference a
    request takes it gives back, so once it has ended `allocated + hit - copied == freed`
    (the source of a partial hit is only pinned while the plan that copies it is built).
    """

    hit: int = 0
    """Blocks reused at admission instead of computed: full blocks shared from the prefix cache (or,
    for n > 1, from completion 0) plus the source block of each partial copy."""
    allocated: int = 0
    """New blocks taken from the pool: at admission, growth, swap-in and recompute after preemption."""
    copied: int = 0
    """Block copies planned for it: a partial-block hit or the copy-on-write block of a fork."""
    freed: int = 0
    """Block references it dropped: when a sequence ended, was preempted or lost its executor."""


@dataclass(slots=True)
class DraftCounts:
    """Speculative decoding for one request: draft tokens sent for verification and how they fared."""

    proposed: int = 0
    accepted: int = 0
    verify_steps: int = 0
    """Steps that verified drafts for it; each also yields one token beyond its accepted drafts."""


@dataclass(slots=True)
class SequenceOutput:
    """One per sequence that produced a token (or finished) in a step."""

    request_id: str
    index: int
    """Which of the request's n completions."""
    new_token_ids: list[int]
    """Includes the eos/stop token that finished the sequence; the API hides special tokens in text."""
    logprobs: list[SampledLogprob] | None
    """Parallel to new_token_ids when the request asked for logprobs."""
    finish_reason: FinishReason | None
    """None while the sequence is still running."""
    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache at the request's first admission."""
    num_output_tokens: int
    """Total so far."""
    queue_time_s: float | None
    """Arrival to first scheduled."""
    ttft_s: float | None
    """Arrival to first output token."""
    blocks: BlockCounts | None = None
    num_host_cached_tokens: int = 0
    """Of `num_cached_tokens`, those loaded for this request from host memory."""
    num_disk_cached_tokens: int = 0
    """Of `num_cached_tokens`, those loaded for this request from disk."""
    """The request's own `BlockCounts`, the same object in each of its outputs (no copy per step):
    complete once every sequence of the request has finished, as with its last final output."""
    drafts: DraftCounts | None = None
    """The request's own `DraftCounts` (speculative decoding), shared like `blocks`."""
    error: str | None = None
    """With `FinishReason.INTERNAL`: what went wrong, for the client's error message."""


@dataclass(slots=True)
class DiskTierStats:
    """The prefix cache's tiers below the pool (`disk_tier.DiskTier`), in total since the executor registered."""

    blocks_on_disk: int = 0
    """Blocks the tiers below the pool hold (disk, and host memory)."""
    loaded_blocks: int = 0
    """Blocks read back from disk into the pool instead of recomputed."""
    failed_loads: int = 0
    """Loads whose block was missing or failed its checks (recomputed instead)."""
    stored_blocks: int = 0
    host_loaded_blocks: int = 0
    """Blocks read back from host memory (`--kv-host-gb`) instead of recomputed."""
    block_bytes: int = 0
    """The bytes of one block in a tier: loads and stores times this are the bytes moved."""
    media: tuple[str, ...] = ()
    """The tiers, by vLLM's KV-event medium names ("CPU": host memory, "DISK")."""


@dataclass(slots=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_swapped: int
    num_blocks: int
    blocks_free: int
    blocks_cached: int
    """Unreferenced blocks still matchable in the prefix tree."""
    blocks_referenced: int
    kv_usage: float
    """blocks_referenced / num_blocks, 0..1."""
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    num_swap_outs: int = 0
    """Preemptions that swapped to CPU; `num_preemptions - num_swap_outs` recomputed."""
    num_evicted_blocks: int = 0
    """Cached blocks taken back from the prefix tree, in total."""
    num_cpu_blocks: int = 0
    cpu_blocks_used: int = 0
    num_steps: int = 0
    num_requests: int = 0
    """Live (unfinished) requests."""
    blocks_reserved: int = 0
    """Free or cached blocks promised to running sequences under a `kv_reservation` policy."""
    draft_tokens_proposed: int = 0
    """Speculative decoding, in total: draft tokens sent for verification."""
    draft_tokens_accepted: int = 0
    draft_verify_steps: int = 0
    """Sequence-steps that verified drafts; each yields one bonus token beyond the accepted drafts."""
    disk: DiskTierStats | None = None
    """The prefix cache's disk tier, when the executor has one."""
