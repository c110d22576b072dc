"""A fake executor that checks every plan: each KV slot stores (token id, position).

It follows the step semantics of `protos.step` literally (drops, swap-out, swap-in,
copies, then the forward pass) with its own copy of every sequence's tokens and block
table, writes each scheduled token into the slot the block table names, and then reads
the whole context back through the block table. A wrong block table, copy or swap, a
write into a block another sequence holds, or a stale `num_computed_tokens` raises
`PlanError`. The sampled token is a hash of (seed, context), like a real sampler with
position-derived randomness: recomputing a sequence yields the same tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from protos.step import SampledToken, StepPlan, StepResult, TokenLogprob


class PlanError(AssertionError):
    pass


@dataclass
class _SeqState:
    tokens: list[int]
    prompt_len: int
    table: list[int]
    computed: int
    seed: int
    logprobs: int | None
    outputs_seen: int = 0


def next_token(tokens: list[int], seed: int, vocab_size: int) -> int:
    tail = tokens[-6:]
    mix = seed * 1_000_003 + sum((i + 1) * t for i, t in enumerate(tail)) * 7919 + len(tokens) * 31
    return mix % vocab_size


@dataclass
class SlotExecutor:
    num_blocks: int
    block_size: int
    num_cpu_blocks: int = 0
    vocab_size: int = 50
    kv: list[tuple[int, int] | None] = field(init=False)
    cpu: dict[int, list] = field(default_factory=dict)
    seqs: dict[int, _SeqState] = field(default_factory=dict)
    steps: int = 0
    tokens_computed: int = 0

    def __post_init__(self) -> None:
        self.kv = [None] * (self.num_blocks * self.block_size)

    def _slot(self, state: _SeqState, pos: int) -> int:
        index = pos // self.block_size
        if index >= len(state.table):
            raise PlanError(f"position {pos} lies beyond the block table {state.table}")
        block = state.table[index]
        if not 0 <= block < self.num_blocks:
            raise PlanError(f"block id {block} out of range")
        return block * self.block_size + pos % self.block_size

    def _block(self, block: int) -> list:
        return self.kv[block * self.block_size:(block + 1) * self.block_size]

    def _verify_context(self, seq_id: int, state: _SeqState, upto: int) -> None:
        for pos in range(upto):
            got = self.kv[self._slot(state, pos)]
            if got != (state.tokens[pos], pos):
                raise PlanError(f"seq {seq_id}: position {pos} reads {got}, expected {(state.tokens[pos], pos)} "
                                f"(table {state.table})")

    def execute(self, plan: StepPlan) -> StepResult:
        bs = self.block_size
        self.steps += 1
        for seq_id in plan.drop_seq_ids:
            self.seqs.pop(seq_id, None)
        for device, cpu_block in plan.swap_out:
            if not 0 <= cpu_block < self.num_cpu_blocks:
                raise PlanError(f"swap-out to CPU block {cpu_block} out of range")
            self.cpu[cpu_block] = self._block(device)
        for cpu_block, device in plan.swap_in:
            if cpu_block not in self.cpu:
                raise PlanError(f"swap-in from CPU block {cpu_block}, which holds nothing")
            self.kv[device * bs:(device + 1) * bs] = self.cpu.pop(cpu_block)
        sources = [self._block(src) for src, _dst in plan.copies]  # batched: all reads before writes
        destinations = [dst for _src, dst in plan.copies]
        if len(set(destinations)) != len(destinations) or set(destinations) & {s for s, _ in plan.copies}:
            raise PlanError(f"copy ops overlap: {plan.copies}")
        for content, dst in zip(sources, destinations):
            self.kv[dst * bs:(dst + 1) * bs] = content
        work: list[tuple[int, _SeqState, int, int]] = []
        for new in plan.new_seqs:
            if new.seq_id in self.seqs:
                raise PlanError(f"NewSequence {new.seq_id} is already known")
            state = _SeqState(list(new.token_ids), new.prompt_len, list(new.block_table), new.num_computed_tokens,
                              new.seed, new.sampling.logprobs)
            if not 0 <= new.num_computed_tokens < len(new.token_ids):
                raise PlanError(f"seq {new.seq_id}: num_computed {new.num_computed_tokens} of {len(new.token_ids)}")
            self._verify_context(new.seq_id, state, new.num_computed_tokens)
            self.seqs[new.seq_id] = state
            work.append((new.seq_id, state, new.num_computed_tokens, new.num_scheduled_tokens))
        for cached in plan.known_seqs:
            state = self.seqs.get(cached.seq_id)
            if state is None:
                raise PlanError(f"KnownSequence {cached.seq_id} is unknown")
            if cached.num_computed_tokens != state.computed:
                raise PlanError(f"seq {cached.seq_id}: plan says {cached.num_computed_tokens} computed, "
                                f"executor computed {state.computed}")
            state.tokens.extend(cached.new_token_ids)
            state.table.extend(cached.new_block_ids)
            work.append((cached.seq_id, state, cached.num_computed_tokens, cached.num_scheduled_tokens))
        owners: Counter[int] = Counter(b for state in self.seqs.values() for b in set(state.table))
        for seq_id, state, start, count in work:
            if count < 1 or start + count > len(state.tokens):
                raise PlanError(f"seq {seq_id}: schedules {count} tokens from {start} of {len(state.tokens)}")
            for pos in range(start, start + count):
                block = state.table[pos // bs] if pos // bs < len(state.table) else None
                if block is not None and owners[block] > 1:
                    raise PlanError(f"seq {seq_id} writes position {pos} into block {block}, "
                                    f"which {owners[block]} sequences hold")
                self.kv[self._slot(state, pos)] = (state.tokens[pos], pos)
            self.tokens_computed += count
        outputs = []
        for seq_id, state, start, count in work:
            self._verify_context(seq_id, state, start + count)
            state.computed = start + count
            if state.computed == len(state.tokens):
                token = next_token(state.tokens, state.seed, self.vocab_size)
                top = [TokenLogprob(token, -0.5)] * state.logprobs if state.logprobs else []
                outputs.append(SampledToken(seq_id, token, -0.5 if state.logprobs is not None else None, top))
        return StepResult(plan.step_id, outputs)


def expected_completion(prompt: Iterable[int], seed: int, max_tokens: int, vocab_size: int = 50,
                        stop_ids: Iterable[int] = ()) -> list[int]:
    """What an unconstrained run of one sequence produces (no preemption, big pool)."""
    tokens = list(prompt)
    out: list[int] = []
    stop = set(stop_ids)
    while len(out) < max_tokens:
        token = next_token(tokens, seed, vocab_size)
        tokens.append(token)
        out.append(token)
        if token in stop:
            break
    return out
