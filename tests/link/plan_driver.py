"""A tiny hand-made 'scheduler' for driving the fake executor in tests: it allocates blocks,
builds delta plans and feeds sampled tokens back, with hooks to preempt, swap and share."""

from __future__ import annotations

from dataclasses import dataclass, field

from protos.sampling import SamplingParams
from protos.step import KnownSequence, NewSequence, StepPlan, StepResult


@dataclass
class DrivenSeq:
    seq_id: int
    tokens: list[int]
    prompt_len: int
    sampling: SamplingParams
    seed: int = 0
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    known: bool = False
    """The executor holds this sequence (so it is sent as cached)."""
    unsent_tokens: list[int] = field(default_factory=list)
    unsent_blocks: list[int] = field(default_factory=list)

    @property
    def outputs(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class PlanDriver:
    def __init__(self, executor, num_blocks: int, block_size: int, first_block: int = 0) -> None:
        self.executor = executor
        self.block_size = block_size
        self.free = list(range(first_block, num_blocks))
        self.seqs: dict[int, DrivenSeq] = {}
        self.step_id = 0
        self.pending_drops: list[int] = []
        self.pending_copies: list[tuple[int, int]] = []
        self.pending_swap_out: list[tuple[int, int]] = []
        self.pending_swap_in: list[tuple[int, int]] = []

    def add(self, seq_id: int, prompt: list[int], sampling: SamplingParams | None = None, seed: int = 0) -> DrivenSeq:
        seq = DrivenSeq(seq_id, list(prompt), len(prompt), sampling or SamplingParams(temperature=0.0), seed)
        self.seqs[seq_id] = seq
        return seq

    def _ensure_blocks(self, seq: DrivenSeq, end: int) -> None:
        while len(seq.blocks) * self.block_size < end:
            block = self.free.pop(0)
            seq.blocks.append(block)
            if seq.known:
                seq.unsent_blocks.append(block)

    def step(self, chunk: int | None = None, only: list[int] | None = None) -> StepResult:
        """Schedule every (or `only` the listed) sequence: the rest of its tokens, at most `chunk`."""
        self.step_id += 1
        plan = StepPlan(self.step_id, drop_seq_ids=self.pending_drops, copies=self.pending_copies,
                        swap_out=self.pending_swap_out, swap_in=self.pending_swap_in)
        self.pending_drops, self.pending_copies, self.pending_swap_out, self.pending_swap_in = [], [], [], []
        scheduled = {}
        for seq in self.seqs.values():
            if only is not None and seq.seq_id not in only:
                continue
            todo = len(seq.tokens) - seq.num_computed
            n = todo if chunk is None else min(chunk, todo)
            self._ensure_blocks(seq, seq.num_computed + n)
            if not seq.known:
                plan.new_seqs.append(NewSequence(seq.seq_id, list(seq.tokens), seq.prompt_len, seq.num_computed, n,
                                                 list(seq.blocks), seq.sampling, seq.seed))
                seq.known = True
            else:
                plan.known_seqs.append(KnownSequence(seq.seq_id, seq.unsent_tokens, seq.num_computed, n,
                                                       seq.unsent_blocks))
            seq.unsent_tokens, seq.unsent_blocks = [], []
            scheduled[seq.seq_id] = n
        result = self.executor.execute(plan)
        for seq_id, n in scheduled.items():
            self.seqs[seq_id].num_computed += n
        for out in result.outputs:
            seq = self.seqs[out.seq_id]
            seq.tokens.append(out.token_id)
            seq.unsent_tokens.append(out.token_id)
        return result

    def preempt(self, seq_id: int) -> None:
        """Recompute-preemption: the executor forgets it, its blocks are freed."""
        seq = self.seqs[seq_id]
        self.pending_drops.append(seq_id)
        self.free.extend(seq.blocks)
        seq.blocks, seq.num_computed, seq.known = [], 0, False
        seq.unsent_tokens, seq.unsent_blocks = [], []

    def swap_out(self, seq_id: int, cpu_blocks: list[int]) -> None:
        seq = self.seqs[seq_id]
        self.pending_drops.append(seq_id)
        self.pending_swap_out += list(zip(seq.blocks, cpu_blocks))
        self.free.extend(seq.blocks)
        seq.blocks, seq.known = [], False
        seq.unsent_tokens, seq.unsent_blocks = [], []

    def swap_in(self, seq_id: int, cpu_blocks: list[int]) -> None:
        seq = self.seqs[seq_id]
        seq.blocks = [self.free.pop() for _ in cpu_blocks]  # different device blocks than before
        self.pending_swap_in += list(zip(cpu_blocks, seq.blocks))

    def finish(self, seq_id: int) -> DrivenSeq:
        seq = self.seqs.pop(seq_id)
        self.pending_drops.append(seq_id)
        self.free.extend(seq.blocks)
        return seq
