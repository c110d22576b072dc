"""The scheduler's knobs, in one dataclass, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config import defaults

PREEMPTION_MODES = ("recompute", "swap")
KV_RESERVATIONS = ("paged", "max-model-len", "prompt-plus-max-tokens")
"""`paged`: blocks as tokens need them. The others preallocate like a contiguous-KV engine."""


@dataclass(slots=True)
class SchedulerConfig:
    """Budgets and policies of one `Scheduler`.

    `num_blocks`, `block_size`, `num_cpu_blocks` and `max_model_len` come from the
    executor's handshake (`kvserve.protos.step.ExecutorInfo`); the rest are serving policy.
    """

    num_blocks: int
    """Device KV blocks, as the executor reported them."""
    block_size: int = defaults.BLOCK_SIZE
    num_cpu_blocks: int = 0
    """CPU swap space in blocks; 0 makes swap preemption fall back to recompute."""
    max_model_len: int = 2048
    max_num_batched_tokens: int = field(
        default=defaults.MAX_NUM_BATCHED_TOKENS, metadata={"help": "token budget per step"}
    )
    max_num_seqs: int = field(default=defaults.MAX_NUM_SEQS, metadata={"help": "sequences per step"})
    preemption_mode: str = field(
        default="recompute",
        metadata={"help": "how running sequences give up memory under pressure", "choices": PREEMPTION_MODES},
    )
    kv_reservation: str = field(
        default="paged",
        metadata={
            "help": "KV memory per sequence: paged = blocks as its tokens need them; max-model-len or "
            "prompt-plus-max-tokens = reserve that many tokens' blocks at admission and hold them until it "
            "ends, like a contiguous-preallocation engine (admission waits while they do not fit)",
            "choices": KV_RESERVATIONS,
        },
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "the prefix cache (requests sharing a prompt prefix reuse its KV blocks)"}
    )
    cache_aware_order: bool = field(
        default=False,
        metadata={"help": "admit the waiting request with the longest prefix-cache hit first (within a priority)"},
    )
    speculative: str = field(
        default="off",
        metadata={
            "help": "speculative decoding, verified in one forward pass with the same tokens as off (on CUDA, up "
            "to rounding: docs/serving.md § Speculative decoding): ngram = "
            "propose the tokens that followed the last n tokens earlier in the request's own prompt and output; "
            "suffix = the same, and over the recent completions of its tenant's requests; draft = the executor's "
            "draft model (--draft-model, a smaller model with the same tokenizer) proposes them",
            "choices": defaults.SPECULATIVE_METHODS,
        },
    )
    num_speculative_tokens: int = field(
        default=defaults.NUM_SPECULATIVE_TOKENS, metadata={"help": "most draft tokens verified per sequence and step"}
    )
    ngram_max: int = field(default=defaults.NGRAM_MAX, metadata={"help": "longest suffix n-gram the lookup matches"})
    ngram_min: int = field(default=defaults.NGRAM_MIN, metadata={"help": "shortest suffix n-gram the lookup matches"})
    suffix_cache_tokens: int = field(
        default=defaults.SUFFIX_CACHE_TOKENS,
        metadata={"help": "tokens of recent completions --speculative suffix looks up (all tenants; oldest go first)"},
    )
    speculative_max_batch: int = field(
        default=defaults.SPECULATIVE_MAX_BATCH,
        metadata={"help": "no drafts in a step with more running sequences than this (the step is compute-bound)"},
    )
    speculative_min_acceptance: float = field(
        default=defaults.SPECULATIVE_MIN_ACCEPTANCE,
        metadata={
            "help": "a sequence whose recent share of accepted drafts is below this stops proposing until it "
            "recovers (one step's worth per skipped step)"
        },
    )
    eos_token_ids: tuple[int, ...] = ()
    debug_invariants: bool = field(
        default=False,
        metadata={"help": "run check_invariants() after every schedule()/update() (slow; for tests and debugging)"},
    )
    cache_aware_window: int = field(
        default=32,
        metadata={"help": "how many waiting sequences the cache-aware order looks at per step (bounds its cost)"},
    )
    cache_aware_max_skips: int = field(
        default=8,
        metadata={
            "help": "starvation bound of the cache-aware order: a sequence overtaken this many times is "
            "admitted next, in FCFS order"
        },
    )

    def __post_init__(self) -> None:
        self.eos_token_ids = tuple(self.eos_token_ids)
        positive = (
            "num_blocks",
            "block_size",
            "max_model_len",
            "max_num_batched_tokens",
            "max_num_seqs",
            "cache_aware_window",
            "num_speculative_tokens",
            "ngram_min",
            "suffix_cache_tokens",
            "speculative_max_batch",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.num_cpu_blocks < 0:
            raise ValueError(f"SchedulerConfig.num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if self.cache_aware_max_skips < 0:
            raise ValueError("SchedulerConfig.cache_aware_max_skips must be >= 0")
        if self.kv_reservation not in KV_RESERVATIONS:
            raise ValueError(
                f"SchedulerConfig.kv_reservation must be one of {KV_RESERVATIONS}, got {self.kv_reservation!r}"
            )
        if self.speculative not in defaults.SPECULATIVE_METHODS:
            raise ValueError(
                f"SchedulerConfig.speculative must be one of {defaults.SPECULATIVE_METHODS}, got {self.speculative!r}"
            )
        if self.ngram_max < self.ngram_min:
            raise ValueError(f"SchedulerConfig.ngram_max ({self.ngram_max}) is below ngram_min ({self.ngram_min})")
        if not 0.0 <= self.speculative_min_acceptance <= 1.0:
            raise ValueError("SchedulerConfig.speculative_min_acceptance must be in [0, 1]")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"SchedulerConfig.preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )

    def reserved_blocks(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks a sequence of this request holds from admission to its end under `kv_reservation`; 0: paged."""
        policy = self.kv_reservation
        if policy == "paged":
            return 0
        tokens = self.max_model_len if policy == "max-model-len" else prompt_len + max_tokens
        return -(-tokens // self.block_size)
