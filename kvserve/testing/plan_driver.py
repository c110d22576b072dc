"""A minimal in-process plan builder, for executor tests and `kvserve bench executor`.

It plays the scheduler's part with none of its policy: blocks come from a plain free
list with reference counts, every active sequence is scheduled every step (a prompt in
chunks, then one token at a time), and sampled tokens are fed back in the next plan
exactly as the real scheduler does. Hooks preempt, swap and share prefixes by hand, so
a test can put an executor through each step-contract case without the real scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.executor.protocol import Executor
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import KnownSequence, NewSequence, StepPlan, StepResult


@dataclass(slots=True)
class DrivenSequence:
    seq_id: int
    token_ids: list[int]
    prompt_len: int
    sampling: SamplingParams
    seed: int
    max_new_tokens: int | None
    """None: it never finishes by itself (step it, then `finish` it)."""
    chunk_size: int | None
    retain: bool = False
    lora_name: str = ""
    """The LoRA adapter it runs under ("": the base model)."""
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False
    """The executor holds this sequence, so it is sent as a KnownSequence."""
    swapped: bool = False
    """Swapped out: not scheduled until `swap_in`."""
    pending: list[int] = field(default_factory=list)
    """Sampled tokens not yet sent back."""
    new_blocks: list[int] = field(default_factory=list)
    """Blocks allocated since the last plan that named this sequence."""

    @property
    def outputs(self) -> list[int]:
        return self.token_ids[self.prompt_len :]


class PlanDriver:
    def __init__(self, executor: Executor, num_blocks: int | None = None, first_block: int = 0) -> None:
        """Blocks [first_block, num_blocks) are handed out lowest first (default: all the executor's)."""
        info = executor.info()
        self.executor = executor
        self.block_size = info.block_size
        self.free = list(range(first_block, num_blocks if num_blocks is not None else info.num_blocks))[::-1]
        self.refs: dict[int, int] = {}
        self.active: dict[int, DrivenSequence] = {}
        self.finished: dict[int, DrivenSequence] = {}
        self.retained: dict[int, list[int]] = {}
        self._drops: list[int] = []
        self._copies: list[tuple[int, int]] = []
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._step = 0
        self.last_results: list[StepResult] = []

    def add(
        self,
        seq_id: int,
        prompt: list[int],
        max_new_tokens: int | None = None,
        *,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        chunk_size: int | None = None,
        prefix_blocks: list[int] | None = None,
        copy_prefix: bool = False,
        retain: bool = False,
        lora_name: str = "",
    ) -> DrivenSequence:
        """Queue a sequence (greedy unless `sampling` says otherwise). `prefix_blocks` are full
        blocks already holding the prompt's first tokens (e.g. another sequence's); they are
        shared, or copied into fresh blocks. `retain` keeps the blocks alive after the
        sequence finishes (a prefix-cache stand-in). `lora_name`: the LoRA adapter it runs under."""
        seq = DrivenSequence(
            seq_id,
            list(prompt),
            len(prompt),
            sampling or SamplingParams(temperature=0.0),
            seed,
            max_new_tokens,
            chunk_size,
            retain,
            lora_name,
        )
        for block in prefix_blocks or []:
            if copy_prefix:
                fresh = self._allocate()
                self._copies.append((block, fresh))
                seq.block_table.append(fresh)
            else:
                self.refs[block] += 1
                seq.block_table.append(block)
        seq.num_computed = len(seq.block_table) * self.block_size
        if seq.num_computed >= len(prompt):
            raise ValueError("at least one prompt token must be computed: the prefix covers the whole prompt")
        self.active[seq_id] = seq
        return seq

    def run(self, max_steps: int = 100_000) -> dict[int, list[int]]:
        """Step until every active sequence finished; returns output tokens per sequence."""
        if any(seq.max_new_tokens is None for seq in self.active.values()):
            raise ValueError("run() needs every sequence to have max_new_tokens")
        for _ in range(max_steps):
            if not any(not seq.swapped for seq in self.active.values()):
                break
            self.step()
        if self._drops:
            self.executor.execute(StepPlan(step_id=self._next_id(), drop_seq_ids=self._take(self._drops)))
        return {seq_id: seq.outputs for seq_id, seq in self.finished.items()}

    def step(self, chunk: int | None = None, only: list[int] | None = None) -> StepResult:
        """Schedule every active sequence (or `only` those listed): the rest of its known
        tokens, at most its own `chunk_size` and at most `chunk`."""
        plan = StepPlan(
            step_id=self._next_id(),
            drop_seq_ids=self._take(self._drops),
            copies=self._take(self._copies),
            swap_out=self._take(self._swap_out),
            swap_in=self._take(self._swap_in),
        )
        scheduled: dict[int, int] = {}
        for seq in self.active.values():
            if seq.swapped or (only is not None and seq.seq_id not in only):
                continue
            limits = [limit for limit in (seq.chunk_size, chunk) if limit is not None]
            count = min([len(seq.token_ids) - seq.num_computed, *limits])
            needed = -(-(seq.num_computed + count) // self.block_size) - len(seq.block_table)
            for _ in range(needed):
                block = self._allocate()
                seq.block_table.append(block)
                seq.new_blocks.append(block)
            scheduled[seq.seq_id] = count
            if not seq.sent:
                plan.new_seqs.append(
                    NewSequence(
                        seq_id=seq.seq_id,
                        token_ids=list(seq.token_ids),
                        prompt_len=seq.prompt_len,
                        num_computed_tokens=seq.num_computed,
                        num_scheduled_tokens=count,
                        block_table=list(seq.block_table),
                        sampling=seq.sampling,
                        seed=seq.seed,
                        lora_name=seq.lora_name,
                    )
                )
                seq.sent = True
            else:
                plan.known_seqs.append(
                    KnownSequence(
                        seq_id=seq.seq_id,
                        new_token_ids=seq.pending,
                        num_computed_tokens=seq.num_computed,
                        num_scheduled_tokens=count,
                        new_block_ids=list(seq.new_blocks),
                    )
                )
            seq.pending, seq.new_blocks = [], []
        result = self.executor.execute(plan)
        self.last_results.append(result)
        for seq_id, count in scheduled.items():
            self.active[seq_id].num_computed += count
        for out in result.outputs:
            seq = self.active[out.seq_id]
            seq.token_ids.append(out.token_id)
            seq.pending.append(out.token_id)
            if seq.max_new_tokens is not None and len(seq.outputs) >= seq.max_new_tokens:
                self.finish(seq.seq_id)
        return result

    # --- what a scheduler does to a sequence between steps ----------------------------

    def finish(self, seq_id: int) -> DrivenSequence:
        """The executor forgets it; its blocks are freed unless it was added with `retain`."""
        seq = self.active.pop(seq_id)
        self.finished[seq_id] = seq
        self._drops.append(seq_id)
        if seq.retain:
            self.retained[seq_id] = list(seq.block_table)
        else:
            self._release_all(seq)
        return seq

    def preempt(self, seq_id: int) -> None:
        """Recompute-preemption: the executor forgets it, its blocks are freed, it starts over."""
        seq = self.active[seq_id]
        self._drops.append(seq_id)
        self._release_all(seq)
        seq.num_computed = 0

    def swap_out(self, seq_id: int, cpu_blocks: list[int]) -> None:
        """Its KV moves to `cpu_blocks` (one per device block); it waits until `swap_in`."""
        seq = self.active[seq_id]
        if len(cpu_blocks) != len(seq.block_table):
            raise ValueError(f"seq {seq_id} holds {len(seq.block_table)} blocks, not {len(cpu_blocks)}")
        self._drops.append(seq_id)
        self._swap_out += list(zip(seq.block_table, cpu_blocks))
        self._release_all(seq)
        seq.swapped = True

    def swap_in(self, seq_id: int, cpu_blocks: list[int]) -> None:
        """Its KV comes back into fresh device blocks; it resumes without recompute."""
        seq = self.active[seq_id]
        seq.block_table = [self._allocate() for _ in cpu_blocks]
        self._swap_in += list(zip(cpu_blocks, seq.block_table))
        seq.swapped = False

    # --- internals ---------------------------------------------------------------------

    def _release_all(self, seq: DrivenSequence) -> None:
        """Hand back every block; the executor will be sent the sequence anew."""
        for block in seq.block_table:
            self._release(block)
        seq.block_table, seq.sent, seq.pending, seq.new_blocks = [], False, [], []

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

    @staticmethod
    def _take(pending: list) -> list:
        """The pending ops for this plan, leaving `pending` empty for the next one."""
        taken = list(pending)
        pending.clear()
        return taken

    def _next_id(self) -> int:
        self._step += 1
        return self._step


RUN_NEW_TOKENS = 12


RUN_NEW_TOKENS = 12


def run_prompts(
    executor: Executor, prompts: list[list[int]], max_new_tokens: int = RUN_NEW_TOKENS, **add: Any
) -> dict[int, list[int]]:
    """Sequence i = prompts[i], each run to `max_new_tokens` greedy tokens (`add`: `PlanDriver.add` options)."""
    driver = PlanDriver(executor)
    for i, prompt in enumerate(prompts):
        driver.add(i, prompt, max_new_tokens=max_new_tokens, **add)
    return driver.run()
