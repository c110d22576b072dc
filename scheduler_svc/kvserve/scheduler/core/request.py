"""Requests and their sequences: the state the scheduler owns for each client request.

A request with `n` completions has `n` sequences. Each sequence moves through

    WAITING ──▶ RUNNING ──▶ FINISHED
                  │  ▲
                  ▼  │
        SWAPPED / PREEMPTED (waiting again, recomputed on resume)

and can be finished (aborted) from every state.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field
from operator import attrgetter

from kvserve.config import defaults
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.stop_rules import FinishReason
from kvserve.scheduler.core.ngram_index import NgramIndex
from kvserve.scheduler.core.outputs import BlockCounts, DraftCounts
from kvserve.scheduler.core.prefix_tree import PrefixNode
from kvserve.scheduler.core.token_matcher import TokenMatcher


class RequestRejected(ValueError):
    """The request can never fit this scheduler's context or KV pool. `field` is "prompt" or "max_tokens"."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    """Never scheduled yet."""
    RUNNING = "running"
    SWAPPED = "swapped"
    """Preempted to CPU swap space; its KV comes back with swap-in."""
    PREEMPTED = "preempted"
    """Preempted by recompute: back in the waiting queue, generated tokens kept."""
    FINISHED = "finished"


WAITING_STATES = (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)

QUEUE_ORDER = attrgetter("sort_key")
"""Key of the priority-ordered queues (`bisect.insort(queue, seq, key=QUEUE_ORDER)`): lower first."""


def resolve_seed(seed: int | None) -> int:
    """The request's seed: the client's, or a fresh random one drawn at admission."""
    return secrets.randbelow(defaults.MAX_SEED + 1) if seed is None else seed


def derive_seed(seed: int, index: int) -> int:
    """Seed of completion `index`: completion 0 keeps `seed`; others get a splitmix64 mix of (seed, index).

    Deterministic, so a recompute after preemption or an executor restart redraws the
    same tokens, and distinct per completion, so n > 1 samples differ.
    """
    if index == 0:
        return seed
    mask = (1 << 64) - 1
    z = (seed + index * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return z % (defaults.MAX_SEED + 1)


@dataclass(slots=True, eq=False)
class Request:
    """One client request: the prompt, its sampling parameters and its `n` sequences."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int
    namespace: str
    arrival_time: float
    order: int
    """Admission counter: breaks ties between equal arrival times (FCFS)."""
    seed: int
    seqs: list[Sequence] = field(default_factory=list)
    num_unfinished: int = 0
    stop_ids: frozenset[int] = frozenset()
    """eos ids (unless ignore_eos) and stop_token_ids: the update() fast path checks only this set."""
    max_output_tokens: int = 0
    """min(max_tokens, max_model_len - prompt length): where the length limit strikes."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache when the request was first admitted."""
    num_host_cached_tokens: int = 0
    """Of those, tokens whose blocks were loaded for it from host memory (`--kv-host-gb`)."""
    num_disk_cached_tokens: int = 0
    """Of those, tokens whose blocks were loaded for it from disk (`--kv-disk-dir`)."""
    queue_time_s: float | None = None
    """Arrival to first scheduled; None until then."""
    ttft_s: float | None = None
    """Arrival to first output token; None until then."""
    prompt_done: bool = False
    """Sequence 0 has computed the whole prompt once: the other completions may fork from it."""
    reserve_blocks: int = 0
    """Block-table size each running sequence is guaranteed under `kv_reservation` (0: paged)."""
    blocks: BlockCounts = field(default_factory=BlockCounts)
    """Blocks hit, allocated, copied and freed for this request so far (handed out in its outputs)."""
    drafts: DraftCounts = field(default_factory=DraftCounts)
    """Speculative decoding: draft tokens proposed and accepted for it so far (summed over its n)."""
    lora_name: str = ""
    """The LoRA adapter its sequences run under ("": the base model), sent in every NewSequence."""


@dataclass(slots=True, eq=False)
class Sequence:
    """One completion: its tokens, KV progress, block table and what the executor already holds."""

    seq_id: int
    request: Request
    index: int
    token_ids: list[int]
    prompt_len: int
    seed: int
    sort_key: tuple[int, float, int, int]
    """(priority, arrival, order, index): lower is served first, and preempted last."""
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0
    """Tokens whose KV is in this sequence's blocks (confirmed by a StepResult)."""
    block_table: list[int] = field(default_factory=list)
    cpu_table: list[int] = field(default_factory=list)
    """CPU swap blocks while SWAPPED."""
    known: bool = False
    """The executor holds this sequence (sent as a NewSequence and not dropped since)."""
    sent_tokens: int = 0
    """How many of `token_ids` the executor holds; the rest go out as new_token_ids."""
    sent_blocks: int = 0
    """How many block-table entries the executor holds; the rest go out as new_block_ids."""
    tree_node: PrefixNode | None = None
    """Prefix-tree node of block `num_tree_blocks - 1` (None: the namespace root)."""
    num_tree_blocks: int = 0
    """Leading blocks of `block_table` that are exactly the tree chain ending at `tree_node`."""
    cache_frozen: bool = False
    """Stop adding this sequence's blocks to the tree (its chain diverged from the tree's)."""
    reserved_blocks: int = 0
    """Blocks the pool holds back for this running sequence's growth: reserve_blocks - len(block_table)."""
    skips: int = 0
    """Times the cache-aware order admitted a later sequence before this one."""
    started_step: int = 0
    """Step id of the plan that last sent this sequence as a NewSequence."""
    finish_reason: FinishReason | None = None
    matcher: TokenMatcher | None = None
    """Structured output: where this completion is in its grammar (None: unconstrained)."""
    ngram: NgramIndex | None = None
    """Speculative decoding: its own tokens' n-grams (built at its first proposal)."""
    draft_rate: float = 1.0
    """Moving average of the share of its drafts accepted; below the threshold it pauses proposing."""
    draft_pause: int = 0
    """Steps left before it proposes again."""
    draft_pause_len: int = 0
    """Length of its last pause: doubled while acceptance stays low, reset once it recovers."""
    executor_drafts: list[int] = field(default_factory=list)
    """`--speculative draft`: what the executor's draft model proposed after its last step."""

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
