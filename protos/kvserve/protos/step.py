"""The scheduler → executor step contract, as plain dataclasses.

The scheduler builds a `StepPlan` each step; the executor runs it and answers with a
`StepResult`. On the wire both are protobuf messages (`protos/kvserve/v1/executor_link.proto`,
encoded by `kvserve.protos.step_codec`); these dataclasses are the in-memory form on each side.

A plan is a *delta*, like vLLM v1's SchedulerOutput:
- `new_seqs` are sequences the executor does not know (first admission, resume after a
  recompute-preemption, swap-in, or after an executor restart). They carry every token id
  known so far, the full block table and the sampling parameters.
- `known_seqs` are sequences the executor already holds. They carry only the token ids
  appended since the previous plan (normally the one token sampled last step) and any
  newly allocated blocks, which extend the block table.

Executor semantics, in order, for one plan:
1. forget every id in `drop_seq_ids` (finished, aborted, preempted or swapped out);
2. run `swap_out` (device block → CPU swap block), then `swap_in` (CPU → device),
   then `copies` (device block → device block, whole block);
3. apply `new_seqs` / `known_seqs` to the per-sequence state;
4. run one forward pass over every scheduled token: for a sequence, the tokens at
   positions [num_computed_tokens, num_computed_tokens + num_scheduled_tokens);
   their KV goes to slot `block_table[pos // block_size] * block_size + pos % block_size`;
5. sample one token for each sequence whose scheduled tokens reach the end of its known
   tokens (num_computed_tokens + num_scheduled_tokens == len(token ids)). A chunk in the
   middle of a prompt samples nothing. A sequence listed in `mask_seq_ids` (structured
   output) samples only among the tokens its row of `token_masks` allows.
The executor does not append the sampled token to its own state: the scheduler decides
whether it is kept and sends it back in the next plan's `known_seqs[...].new_token_ids`.

Speculative decoding extends steps 4 and 5 for a known sequence with `draft_token_ids`: the
drafts follow its known tokens as if known (so num_computed_tokens + num_scheduled_tokens ==
len(token ids) + len(drafts)), a token is drawn at each of the len(drafts) + 1 last positions
exactly as an ordinary decode step would draw it there, and the sequence's outputs are those
draws up to and including the first that differs from its draft (all of them when none does):
consecutive `SampledToken`s with its id, in order. The scheduler rolls back the KV slots of
rejected drafts by `trims` (applied with the drops), and nothing unverified is ever kept.
With a draft model (`ExecutorInfo.draft_model_id`), the plan's `draft_requests` ask the
executor to propose the next step's drafts itself, after sampling: `StepResult.proposals`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.protos.sampling import SamplingParams


class PlanError(ValueError):
    """A plan breaks this contract or disagrees with the executor's state: a scheduler bug.

    One class for every executor (the torch runner's batch builder, the fake executor and
    its strict mode), so the link reports it by one name and tests catch it by one type.
    """


@dataclass(slots=True)
class NewSequence:
    """A sequence the executor has not seen (or must rebuild from scratch)."""

    seq_id: int
    token_ids: list[int]
    """All token ids known so far: prompt, plus already generated ones after a recompute."""
    prompt_len: int
    """How many of `token_ids` are prompt; the rest are outputs (for penalties and seeds)."""
    num_computed_tokens: int
    """Tokens whose KV is already in the cache (prefix hit, copied block or swap-in)."""
    num_scheduled_tokens: int
    block_table: list[int]
    sampling: SamplingParams
    seed: int
    """Resolved seed: draws depend only on (seed, output position), never on batch order."""
    lora_name: str = ""
    """The LoRA adapter the sequence runs under (one of `ExecutorInfo.lora_names`); "": the base model."""


@dataclass(slots=True)
class KnownSequence:
    """A sequence the executor already holds; only what changed since the last plan."""

    seq_id: int
    new_token_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    new_block_ids: list[int] = field(default_factory=list)
    """Physical blocks appended to the end of the block table."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: proposed tokens after the known ones, verified in this step only."""


@dataclass(slots=True)
class StepPlan:
    step_id: int
    new_seqs: list[NewSequence] = field(default_factory=list)
    known_seqs: list[KnownSequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    """(src_block, dst_block) device copies: copy-on-write and partial-prefix reuse."""
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(device_block, cpu_block) pairs."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(cpu_block, device_block) pairs."""
    drop_seq_ids: list[int] = field(default_factory=list)
    trims: list[tuple[int, int]] = field(default_factory=list)
    """(seq_id, num_blocks): keep only the first num_blocks of the sequence's block table (applied
    with the drops; speculative decoding's rollback of blocks that held only rejected drafts)."""
    draft_requests: list[tuple[int, int]] = field(default_factory=list)
    """(seq_id, num_tokens): after this step, the executor's draft model proposes that many tokens
    to follow the sequence (speculative decoding with `--draft-model`), in `StepResult.proposals`."""
    mask_seq_ids: list[int] = field(default_factory=list)
    """Constrained sequences that sample this step, one row of `token_masks` each, in this order."""
    token_masks: bytes = b""
    """Rows of equal length (`mask_row_bytes`), little-endian uint32 words: token t is allowed iff bit
    t % 32 of word t // 32 is set; tokens past a row's bits are not. The scheduler's grammar matcher
    fills them (vLLM v1 also computes the bitmask in its scheduler); the executor only applies them."""
    store_blocks: list[tuple[int, int]] = field(default_factory=list)
    """(device_block, key): write the block's KV to the tiers below the pool under `key`, before
    anything else of this step (the block may be reused by this very plan)."""
    load_blocks: list[tuple[int, int]] = field(default_factory=list)
    """(device_block, key): read block `key` from the tiers below the pool (host memory first) into the
    device block, after the stores and before the block ops; one that fails is listed in
    `StepResult.failed_load_blocks`."""

    @property
    def mask_row_bytes(self) -> int:
        """Bytes per row of `token_masks` (0 without constrained rows)."""
        return len(self.token_masks) // len(self.mask_seq_ids) if self.mask_seq_ids else 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.new_seqs) + sum(s.num_scheduled_tokens for s in self.known_seqs)

    @property
    def is_empty(self) -> bool:
        return not (
            self.new_seqs
            or self.known_seqs
            or self.copies
            or self.swap_out
            or self.swap_in
            or self.drop_seq_ids
            or self.trims
            or self.store_blocks
            or self.load_blocks
        )


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(slots=True)
class SampledToken:
    """A token sampled for one sequence in one step (one per sequence, or more after verified drafts)."""

    seq_id: int
    token_id: int
    logprob: float | None = None
    """Log-probability of `token_id`, present when the request asked for logprobs."""
    top_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    step_id: int
    outputs: list[SampledToken] = field(default_factory=list)
    execute_time_s: float = 0.0
    proposals: list[tuple[int, list[int]]] = field(default_factory=list)
    """(seq_id, draft tokens) the plan's `draft_requests` asked for, proposed after this step's tokens."""
    failed_load_blocks: list[int] = field(default_factory=list)
    """The plan's `load_blocks` whose file was missing or failed its checks: they hold no KV."""
    disk_load_blocks: list[int] = field(default_factory=list)
    """The plan's `load_blocks` read from the disk; the others loaded came from host memory."""
    dropped_keys: list[int] = field(default_factory=list)
    """Keys no tier below the pool holds any more (evicted for room): loads of them would miss."""


@dataclass(slots=True)
class ExecutorInfo:
    """What an executor reports at the handshake; the scheduler sizes itself from it."""

    model_id: str
    """Identity of the loaded weights; part of every prefix-cache namespace."""
    num_blocks: int
    block_size: int
    num_cpu_blocks: int
    """Blocks of CPU swap space (0: swap-preemption unavailable)."""
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    tokenizer_path: str
    """A directory holding tokenizer.json and tokenizer_config.json (with chat_template)."""
    executor_kind: str
    """"torch" or "fake"."""
    device: str = "cpu"
    dtype: str = "float32"
    attention_backend: str = "torch"
    num_threads: int = 0
    """The executor's compute threads on a CPU (torch's intra-op threads); 0 on an accelerator or
    where no model runs (the fake executor)."""
    draft_model_id: str = ""
    """The draft model speculative decoding's `draft` method asks for proposals ("": none loaded)."""
    lora_names: list[str] = field(default_factory=list)
    """The LoRA adapters a request may name (`--lora NAME=PATH`), in the order given."""
    kv_fingerprint: str = ""
    """The tiers below the pool (`--kv-host-gb`, `--kv-disk-dir`): what a block's KV depends on besides
    its tokens, which seeds every block key; "" without tiers."""
    kv_disk_keys: list[int] = field(default_factory=list)
    """The keys of the blocks on disk at the handshake (a warm restart's prefix cache)."""
    kv_block_bytes: int = 0
    """The bytes one block takes in a tier (its K and V in every layer)."""
    kv_tiers: list[str] = field(default_factory=list)
    """The tiers this executor has, by vLLM's KV-event medium names (`kv_events.MEDIUM_CPU`, `MEDIUM_DISK`)."""
