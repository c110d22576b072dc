"""The sequences the fake executor knows, and the plan checks that keep them in step with the scheduler.

A real executor trusts the plan's sequence deltas; the fake checks each one the way a careful
executor would and raises `PlanError` naming the sequence: known and unknown ids, a LoRA adapter
it was given (`--lora`), prompt and computed lengths in range, token ids inside the vocabulary,
block ids in range and unique, a new sequence's computed prefix already in its blocks (read back
from the shadow KV), `num_computed_tokens` as computed, `new_token_ids` starting with the token
sampled last step, scheduled positions known and below `max_model_len`. It lives apart from
`executor.FakeExecutor`, which applies a whole plan in order and samples, so the state of one
sequence and its checks read in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.executor.fake.adapters import lora_salt
from kvserve.executor.fake.scripted_reply import ScriptedReplies
from kvserve.executor.fake.shadow_kv import ShadowKV
from kvserve.executor.fake.vocabulary import Vocabulary
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import PlanError


@dataclass(slots=True)
class FakeSequence:
    """One sequence as the fake executor holds it between steps."""

    token_ids: list[int]
    prompt_len: int
    block_table: list[int]
    sampling: SamplingParams
    seed: int
    num_computed: int
    last_sampled: int | None = None
    """Token sampled in the previous step, which the next plan must send back first."""
    drafts: list[int] = field(default_factory=list)
    """This step's proposed tokens (speculative decoding), written and verified after the known ones."""
    script: list[int] | None = None
    """The prompt's scripted reply (`--scripted-replies`), None for an ordinary prompt."""
    lora_salt: int = 0
    """Its LoRA adapter's salt of every draw (`adapters.lora_salt`; 0: the base model)."""

    def step_tokens(self) -> list[int]:
        return self.token_ids + self.drafts if self.drafts else self.token_ids


class SequenceTable:
    """The fake executor's sequences by id, changed only through checked plan deltas."""

    def __init__(
        self,
        shadow: ShadowKV,
        vocab: Vocabulary,
        max_model_len: int,
        *,
        strict: bool,
        scripts: ScriptedReplies | None,
        loras: tuple[str, ...] = (),
    ) -> None:
        self.by_id: dict[int, FakeSequence] = {}
        self.loras = frozenset(loras)
        """The adapters a new sequence may name (the executor's, changed by runtime loads)."""
        self._shadow = shadow
        self._vocab = vocab
        self._max_model_len = max_model_len
        self._strict = strict
        self._scripts = scripts

    def clear(self) -> None:
        self.by_id.clear()

    def known(self, seq_id: int) -> FakeSequence:
        seq = self.by_id.get(seq_id)
        if seq is None:
            raise PlanError(f"seq {seq_id}: unknown to the executor (never sent as new, or dropped)")
        return seq

    def drop(self, seq_id: int) -> None:
        seq = self.by_id.pop(seq_id, None)
        if seq is not None:  # dropping an unknown id is harmless (e.g. after a reset)
            self._shadow.release(seq.block_table)

    def admit(
        self,
        seq_id: int,
        token_ids: list[int],
        prompt_len: int,
        num_computed: int,
        block_table: list[int],
        sampling: SamplingParams,
        seed: int,
        lora_name: str = "",
    ) -> FakeSequence:
        what = f"new seq {seq_id}"
        if seq_id in self.by_id:
            raise PlanError(f"{what}: already known; drop it first or send it as a cached sequence")
        if lora_name and lora_name not in self.loras:
            known = ", ".join(map(repr, sorted(self.loras))) or "none"
            raise PlanError(f"{what}: LoRA adapter {lora_name[:100]!r} was not given to this executor (it has {known})")
        if not 0 < prompt_len <= len(token_ids):
            raise PlanError(f"{what}: prompt_len {prompt_len} not in [1, {len(token_ids)}]")
        if not 0 <= num_computed <= len(token_ids):
            raise PlanError(f"{what}: num_computed_tokens {num_computed} not in [0, {len(token_ids)}]")
        self.check_tokens(token_ids, what)
        for block in block_table:
            self._shadow.check_block(block, what)
        if len(set(block_table)) != len(block_table):
            raise PlanError(f"{what}: block table {block_table} holds a block twice")
        seq = FakeSequence(list(token_ids), prompt_len, list(block_table), sampling, seed, num_computed)
        seq.lora_salt = lora_salt(lora_name)
        if self._scripts is not None:
            seq.script = self._scripts.script(seq.token_ids[:prompt_len])
        self._shadow.check_covered(seq.block_table, num_computed, what)
        if num_computed:
            # Prefix-cache hit, copied block or swap-in: the KV must already hold these tokens.
            self._shadow.compare(seq.block_table, seq.token_ids, 0, num_computed, what, "already-computed")
        self.by_id[seq_id] = seq
        self._shadow.hold(seq.block_table)
        return seq

    def trim(self, seq_id: int, num_blocks: int) -> None:
        seq = self.known(seq_id)
        if not 0 < num_blocks <= len(seq.block_table):
            raise PlanError(f"seq {seq_id}: trimmed to {num_blocks} blocks, but its table has {len(seq.block_table)}")
        self._shadow.release(seq.block_table[num_blocks:])
        del seq.block_table[num_blocks:]

    def advance(
        self, seq_id: int, new_token_ids: list[int], num_computed: int, new_block_ids: list[int]
    ) -> FakeSequence:
        what = f"cached seq {seq_id}"
        seq = self.known(seq_id)
        if num_computed != seq.num_computed:
            raise PlanError(
                f"{what}: num_computed_tokens is {num_computed} but the executor computed {seq.num_computed}"
            )
        if seq.last_sampled is not None and new_token_ids and new_token_ids[0] != seq.last_sampled:
            raise PlanError(
                f"{what}: new_token_ids starts with {new_token_ids[0]} but the executor sampled {seq.last_sampled}"
            )
        self.check_tokens(new_token_ids, what)
        for block in new_block_ids:
            self._shadow.check_block(block, what)
            if block in seq.block_table:
                raise PlanError(f"{what}: new block {block} is already in its block table")
        seq.token_ids.extend(new_token_ids)
        seq.block_table.extend(new_block_ids)
        self._shadow.hold(new_block_ids)
        seq.last_sampled = None
        return seq

    def check_tokens(self, token_ids: list[int], what: str) -> None:
        vocab = self._vocab
        if token_ids and (min(token_ids) < 0 or (vocab.bounded and max(token_ids) >= vocab.size)):
            raise PlanError(f"{what}: token ids outside the vocabulary [0, {vocab.size})")

    def write(self, seq_id: int, seq: FakeSequence, num_scheduled: int) -> None:
        """The forward pass's write: the scheduled positions' tokens into their slots."""
        what = f"seq {seq_id}"
        start, end = seq.num_computed, seq.num_computed + num_scheduled
        tokens = seq.step_tokens()
        if num_scheduled < 0 or end > len(tokens):
            raise PlanError(f"{what}: schedules positions [{start}, {end}) but only {len(tokens)} tokens are known")
        if seq.drafts and end != len(tokens):
            raise PlanError(f"{what}: sends drafts but schedules positions [{start}, {end}) of {len(tokens)}")
        if end > self._max_model_len:
            raise PlanError(f"{what}: position {end - 1} exceeds max_model_len {self._max_model_len}")
        if num_scheduled == 0:
            if self._strict:
                raise PlanError(f"{what}: is in the plan but schedules no tokens")
            return
        self._shadow.write(seq.block_table, tokens, start, end, what)
        seq.num_computed = end
