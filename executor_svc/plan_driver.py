"""A minimal in-process plan builder, for tests and `kvserve bench executor`.

It plays the scheduler's part with none of its policy: blocks come from a plain free
list with reference counts, every active sequence is scheduled every step (a prompt in
chunks of `chunk_size`, then one token at a time), and sampled tokens are fed back in
the next plan exactly as the real scheduler does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protos.sampling import SamplingParams
from protos.step import KnownSequence, NewSequence, StepPlan, StepResult
from executor_svc.protocol import Executor


@dataclass(slots=True)
class DrivenSequence:
    seq_id: int
    token_ids: list[int]
    prompt_len: int
    sampling: SamplingParams
    seed: int
    max_new_tokens: int
    chunk_size: int | None
    retain: bool = False
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False
    pending: list[int] = field(default_factory=list)
    new_blocks: list[int] = field(default_factory=list)

    @property
    def outputs(self) -> list[int]:
        return self.token_ids[self.prompt_len:]


class PlanDriver:
    def __init__(self, executor: Executor, num_blocks: int | None = None) -> None:
        info = executor.info()
        self.executor = executor
        self.block_size = info.block_size
        self.free = list(range(num_blocks if num_blocks is not None else info.num_blocks))[::-1]
        self.refs: dict[int, int] = {}
        self.active: dict[int, DrivenSequence] = {}
        self.finished: dict[int, DrivenSequence] = {}
        self.retained: dict[int, list[int]] = {}
        self._drops: list[int] = []
        self._copies: list[tuple[int, int]] = []
        self._step = 0
        self.last_results: list[StepResult] = []

    def add(self, seq_id: int, prompt: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
            seed: int = 0, chunk_size: int | None = None, prefix_blocks: list[int] | None = None,
            copy_prefix: bool = False, retain: bool = False) -> None:
        """Queue a sequence. `prefix_blocks` are full blocks already holding the prompt's first
        tokens (e.g. another sequence's); they are shared, or copied into fresh blocks.
        `retain` keeps the blocks alive after the sequence finishes (a prefix-cache stand-in)."""
        seq = DrivenSequence(seq_id, list(prompt), len(prompt), sampling or SamplingParams(temperature=0.0),
                             seed, max_new_tokens, chunk_size, retain)
        for block in prefix_blocks or []:
            if copy_prefix:
                fresh = self._allocate()
                self._copies.append((block, fresh))
                seq.block_table.append(fresh)
            else:
                self.refs[block] += 1
                seq.block_table.append(block)
        seq.num_computed = len(seq.block_table) * self.block_size
        assert seq.num_computed < len(prompt), "at least one prompt token must be computed"
        self.active[seq_id] = seq

    def run(self, max_steps: int = 100_000) -> dict[int, list[int]]:
        """Step until every active sequence finished; returns output tokens per sequence."""
        for _ in range(max_steps):
            if not self.active:
                break
            self.step()
        if self._drops:
            self.executor.execute(StepPlan(step_id=self._next_id(), drop_seq_ids=self._take_drops()))
        return {seq_id: seq.outputs for seq_id, seq in self.finished.items()}

    def step(self) -> StepResult:
        plan = StepPlan(step_id=self._next_id(), drop_seq_ids=self._take_drops(), copies=self._copies)
        self._copies = []
        scheduled: dict[int, int] = {}
        for seq in self.active.values():
            remaining = len(seq.token_ids) - seq.num_computed
            count = remaining if seq.chunk_size is None else min(seq.chunk_size, remaining)
            needed = -(-(seq.num_computed + count) // self.block_size) - len(seq.block_table)
            for _ in range(needed):
                block = self._allocate()
                seq.block_table.append(block)
                seq.new_blocks.append(block)
            scheduled[seq.seq_id] = count
            if not seq.sent:
                plan.new_seqs.append(NewSequence(
                    seq_id=seq.seq_id, token_ids=list(seq.token_ids), prompt_len=seq.prompt_len,
                    num_computed_tokens=seq.num_computed, num_scheduled_tokens=count,
                    block_table=list(seq.block_table), sampling=seq.sampling, seed=seq.seed))
                seq.sent = True
            else:
                plan.known_seqs.append(KnownSequence(
                    seq_id=seq.seq_id, new_token_ids=seq.pending, num_computed_tokens=seq.num_computed,
                    num_scheduled_tokens=count, new_block_ids=list(seq.new_blocks)))
            seq.pending, seq.new_blocks = [], []
        result = self.executor.execute(plan)
        self.last_results.append(result)
        for seq_id, count in scheduled.items():
            self.active[seq_id].num_computed += count
        for out in result.outputs:
            seq = self.active[out.seq_id]
            seq.token_ids.append(out.token_id)
            seq.pending.append(out.token_id)
            if len(seq.outputs) >= seq.max_new_tokens:
                self._finish(seq)
        return result

    def _finish(self, seq: DrivenSequence) -> None:
        del self.active[seq.seq_id]
        self.finished[seq.seq_id] = seq
        self._drops.append(seq.seq_id)
        if seq.retain:
            self.retained[seq.seq_id] = list(seq.block_table)
            return
        for block in seq.block_table:
            self._release(block)

    def _allocate(self) -> int:
        if not self.free:
            raise RuntimeError("plan driver ran out of KV blocks")
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            del self.refs[block]
            self.free.append(block)

    def _take_drops(self) -> list[int]:
        drops, self._drops = self._drops, []
        return drops

    def _next_id(self) -> int:
        self._step += 1
        return self._step
