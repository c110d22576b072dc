"""Per-sequence state the executor rebuilds from plans: tokens, block table, sampling.

The scheduler owns the truth; this is a cache keyed by sequence id so that a plan only
needs to carry deltas. `reset()` on the runner simply clears it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import KnownSequence, NewSequence, PlanError


class UnknownSequenceError(PlanError):
    """A plan refers to a known sequence the executor does not hold (needs a re-sync)."""


@dataclass(slots=True)
class SequenceState:
    seq_id: int
    token_ids: list[int]
    prompt_len: int
    block_table: list[int]
    sampling: SamplingParams
    seed: int
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    """This step's proposed tokens (speculative decoding), scored after the known ones."""
    lora_name: str = ""
    """The LoRA adapter the sequence runs under, from its NewSequence ("": the base model)."""

    @property
    def output_len(self) -> int:
        """How many tokens after the prompt are known; the next draw's output position."""
        return len(self.token_ids) - self.prompt_len

    @property
    def samples_this_step(self) -> bool:
        return self.num_computed_tokens + self.num_scheduled_tokens == len(self.token_ids) + len(self.draft_token_ids)

    def step_tokens(self) -> list[int]:
        """The tokens this step's positions read: the known ones, then any drafts."""
        return self.token_ids + self.draft_token_ids if self.draft_token_ids else self.token_ids


class SequenceTable:
    """All sequences the executor holds, updated in plan order."""

    def __init__(self) -> None:
        self._seqs: dict[int, SequenceState] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def drop(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)

    def clear(self) -> None:
        self._seqs.clear()

    def trim(self, trims: list[tuple[int, int]]) -> None:
        """Cut block tables back (speculative decoding's rollback of blocks that held only rejected drafts)."""
        for seq_id, num_blocks in trims:
            state = self._seqs.get(seq_id)
            if state is None:
                raise UnknownSequenceError(f"plan trims sequence {seq_id}, which the executor does not hold")
            if not 0 < num_blocks <= len(state.block_table):
                raise PlanError(
                    f"plan trims sequence {seq_id} to {num_blocks} blocks; its table has {len(state.block_table)}"
                )
            del state.block_table[num_blocks:]

    def add(self, seq: NewSequence) -> SequenceState:
        state = SequenceState(
            seq_id=seq.seq_id,
            token_ids=list(seq.token_ids),
            prompt_len=seq.prompt_len,
            block_table=list(seq.block_table),
            sampling=seq.sampling,
            seed=seq.seed,
            num_computed_tokens=seq.num_computed_tokens,
            num_scheduled_tokens=seq.num_scheduled_tokens,
            lora_name=seq.lora_name,
        )
        self._seqs[seq.seq_id] = state
        return state

    def update(self, seq: KnownSequence) -> SequenceState:
        state = self._seqs.get(seq.seq_id)
        if state is None:
            raise UnknownSequenceError(f"plan updates sequence {seq.seq_id}, which the executor does not hold")
        state.token_ids.extend(seq.new_token_ids)
        state.block_table.extend(seq.new_block_ids)
        state.num_computed_tokens = seq.num_computed_tokens
        state.num_scheduled_tokens = seq.num_scheduled_tokens
        state.draft_token_ids = seq.draft_token_ids
        return state
