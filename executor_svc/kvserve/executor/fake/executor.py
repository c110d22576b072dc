"""An executor without a model: deterministic tokens, a shadow KV cache, strict plan checks.

It exists so scheduler, API and reliability tests run fast, and so they catch scheduler
bugs a real model would hide behind plausible-looking text:

- a *shadow KV cache* (`kvserve.executor.fake.shadow_kv`: one slot per token, plus the CPU swap
  space) receives every computed token's id at its slot
  `block_table[pos // block_size] * block_size + pos % block_size`; swaps and copies move
  slots exactly as they would move K/V;
- the next token (`kvserve.executor.fake.tokens`) is a hash of the last few context tokens
  *read back from the slots through the block table*, the context length and (when
  sampling) the seed. A wrong block table, a stale prefix hit or a bad copy therefore
  changes the output, and the read-back is also compared with the plan's tokens so it
  fails loudly with `PlanError`;
- every plan is checked the way a careful executor would: known / unknown sequence ids,
  positions covered by the block table, block ids in range, no write into a block that
  another live sequence shares, copies and swap-ins only into unowned blocks,
  `num_computed_tokens` in step with what was computed, and `new_token_ids` starting
  with the token sampled last step.

Strict mode (`FakeExecutorConfig.strict`, for the scheduler's own tests) checks more at
a cost: slots hold (token id, position), every scheduled sequence's whole context is
read back after the forward pass, and block moves and empty schedules are refused.

Tokens depend only on the context and the seed, never on the batch, so recompute after
preemption, swap and executor restarts reproduce outputs exactly. A structured-output
mask restricts the draw to the tokens it allows (ordinary ones first), so `choice` and
fixed-string regexes come out whole. `logit_bias` is honoured simply (`tokens.biased_token`):
the allowed token with the highest positive bias is picked (lowest id on a tie), and a banned
(-100) token is never picked. No torch import.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from kvserve.config import defaults
from kvserve.config.flags import flag
from kvserve.executor.fake.faults import forbidden_token
from kvserve.executor.fake.scripted_reply import ScriptedReplies
from kvserve.executor.fake.shadow_kv import ShadowKV
from kvserve.executor.fake.tokens import (
    DEFAULT_CONTEXT_WINDOW,
    allowed_token_ids,
    biased_token,
    context_hash,
    copied_token,
    copies,
    fake_logprob,
    hash_ints,
    pick_allowed,
    pick_token,
    top_logprobs,
    wants_eos,
)
from kvserve.executor.fake.vocabulary import default_model_dir, load_vocabulary, plain_vocabulary
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import ExecutorInfo, PlanError, SampledToken, StepPlan, StepResult
from kvserve.protos.stop_rules import stop_token_ids, stop_tokens_allowed

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class FakeExecutorConfig:
    """The fake executor's knobs; each field is also a `kvserve executor` flag (help in its metadata)."""

    num_blocks: int = field(default=8192, metadata=flag("KV blocks"))
    block_size: int = defaults.BLOCK_SIZE
    """Any positive size here: the scheduler's tests use blocks of 1-4 tokens to cross many block
    boundaries. From the command line it is the runner's `--block-size` (`RunnerConfig.block_size`),
    so a served fake executor takes only `kvserve.config.defaults.BLOCK_SIZES`, like the model runner."""
    num_cpu_blocks: int = field(default=0, metadata=flag("CPU swap blocks (0: no swap-preemption)"))
    max_model_len: int | None = None
    """None: the tokenizer dir's config.json max_position_embeddings, else 8192."""
    vocab_size: int | None = field(
        default=None,
        metadata=flag("vocabulary size; None: config.json vocab_size, else the size of tokenizer.json's vocabulary"),
    )
    tokenizer_path: str | None = field(
        default=None,
        metadata=flag("directory with tokenizer.json reported to the scheduler; None: the default model's directory"),
    )
    step_latency_ms: float = field(
        default=0.0, metadata=flag("minimum duration of each step, like a real forward pass")
    )
    eos_probability: float = field(
        default=0.0, metadata=flag("deterministic chance (per context) that a sampled token is eos (0: never)")
    )
    context_window: int = field(
        default=DEFAULT_CONTEXT_WINDOW, metadata=flag("how many trailing context tokens the next token depends on")
    )
    copy_period: int = field(
        default=0,
        metadata=flag(
            "0: every token is a hash of its context; N: a token repeats the context token N positions back "
            "when that is an ordinary token (every greedy draw, three sampled draws in four): a model that "
            "copies its input, as speculative decoding's lookup proposers expect"
        ),
    )
    draft_model: str | None = None
    """From the runner's --draft-model: any value makes this a fake draft model too (its proposals are its own
    next tokens, each wrong on purpose one time in four)."""
    model_id: str | None = field(
        default=None, metadata=flag("model id reported to the scheduler; None: fake:<the tokenizer's model name>")
    )
    strict: bool = field(
        default=False,
        metadata=flag(
            "check every plan as strictly as the scheduler's tests need: (token, position) slots and "
            "whole-context read-backs; with --vocab-size and no --tokenizer-path it needs no model files"
        ),
    )
    scripted_replies: bool = field(
        default=False,
        metadata=flag(
            "tests: answer a prompt holding [[fake-reply]]TEXT[[/fake-reply]] with TEXT's tokens, then eos "
            "(kvserve.executor.fake.scripted_reply)"
        ),
    )
    fault_violate_token_masks: bool = field(
        default=False,
        metadata=flag(
            "FAULT INJECTION, tests only: under a structured-output mask, draw a token the mask forbids, as a "
            "broken executor would (kvserve.executor.fake.faults)"
        ),
    )


@dataclass(slots=True)
class _Sequence:
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

    def step_tokens(self) -> list[int]:
        return self.token_ids + self.drafts if self.drafts else self.token_ids


class FakeExecutor:
    """`kvserve.executor.protocol.Executor` with a shadow KV cache instead of a model."""

    def __init__(self, config: FakeExecutorConfig | None = None) -> None:
        self.config = config = config or FakeExecutorConfig()
        if config.block_size < 1:
            raise ValueError(f"--block-size must be positive, got {config.block_size!r}")
        if config.num_blocks < 1 or config.num_cpu_blocks < 0:
            raise ValueError("num_blocks must be positive, num_cpu_blocks non-negative")
        if config.strict and config.vocab_size and not config.tokenizer_path:
            self.tokenizer_path = ""
            self.vocab = plain_vocabulary(config.vocab_size)
        else:
            tokenizer_dir = Path(config.tokenizer_path) if config.tokenizer_path else default_model_dir()
            self.tokenizer_path = str(tokenizer_dir)
            self.vocab = load_vocabulary(tokenizer_dir, config.vocab_size)
        self.max_model_len = config.max_model_len or self.vocab.max_position_embeddings or 8192
        self.shadow = ShadowKV(config.num_blocks, config.block_size, config.num_cpu_blocks, strict=config.strict)
        self.seqs: dict[int, _Sequence] = {}
        self.steps = 0
        self._samplable_set = frozenset(self.vocab.samplable)
        self._scripts = ScriptedReplies(self.tokenizer_path) if config.scripted_replies else None

    # --- Executor protocol -------------------------------------------------------

    def info(self) -> ExecutorInfo:
        cfg = self.config
        return ExecutorInfo(
            model_id=cfg.model_id or f"fake:{self.vocab.name}",
            num_blocks=cfg.num_blocks,
            block_size=cfg.block_size,
            num_cpu_blocks=cfg.num_cpu_blocks,
            vocab_size=self.vocab.size,
            max_model_len=self.max_model_len,
            eos_token_ids=list(self.vocab.eos_token_ids),
            tokenizer_path=self.tokenizer_path,
            executor_kind="fake",
            device="cpu",
            dtype="none",
            attention_backend="none",
            draft_model_id="fake-draft" if cfg.draft_model else "",
        )

    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        for seq_id in plan.drop_seq_ids:
            self._drop(seq_id)
        for seq_id, num_blocks in plan.trims:
            self._trim(seq_id, num_blocks)
        self.shadow.swap_out(plan.swap_out)
        self.shadow.swap_in(plan.swap_in)
        self.shadow.copy(plan.copies)
        scheduled: list[tuple[int, _Sequence, int]] = []
        for new in plan.new_seqs:
            seq = self._admit(
                new.seq_id,
                new.token_ids,
                new.prompt_len,
                new.num_computed_tokens,
                new.block_table,
                new.sampling,
                new.seed,
            )
            scheduled.append((new.seq_id, seq, new.num_scheduled_tokens))
        for cached in plan.known_seqs:
            seq = self._advance(cached.seq_id, cached.new_token_ids, cached.num_computed_tokens, cached.new_block_ids)
            self._check_tokens(cached.draft_token_ids, f"cached seq {cached.seq_id}'s drafts")
            seq.drafts = cached.draft_token_ids
            scheduled.append((cached.seq_id, seq, cached.num_scheduled_tokens))
        if len({seq_id for seq_id, _, _ in scheduled}) != len(scheduled):
            raise PlanError(f"step {plan.step_id}: a sequence appears twice in the plan")
        for seq_id, seq, num_scheduled in scheduled:  # the forward pass writes every token first
            self._write(seq_id, seq, num_scheduled)
        outputs = []
        masks = _mask_rows(plan)
        for seq_id, seq, num_scheduled in scheduled:
            if self.config.strict:
                self.shadow.compare(seq.block_table, seq.step_tokens(), 0, seq.num_computed, f"seq {seq_id}", "context")
            if num_scheduled > 0 and seq.num_computed == len(seq.token_ids) + len(seq.drafts):
                rows = masks.pop(seq_id, None)
                if rows is not None and len(rows) != len(seq.drafts) + 1:
                    raise PlanError(
                        f"seq {seq_id}: {len(rows)} token masks for {len(seq.drafts) + 1} sampled positions"
                    )
                if seq.drafts:
                    outputs.extend(self._verify(seq_id, seq, rows))
                else:
                    outputs.append(self._sample(seq_id, seq, seq.token_ids, rows[0] if rows else None))
            seq.drafts = []
        if masks:
            raise PlanError(f"step {plan.step_id}: token masks for sequences that sample nothing: {sorted(masks)}")
        proposals = self._proposals(plan, outputs) if plan.draft_requests else []
        self.steps += 1
        latency = self.config.step_latency_ms / 1000.0
        elapsed = time.perf_counter() - started
        if latency > elapsed:
            time.sleep(latency - elapsed)
        return StepResult(
            step_id=plan.step_id, outputs=outputs, execute_time_s=time.perf_counter() - started, proposals=proposals
        )

    def _proposals(self, plan: StepPlan, outputs: list[SampledToken]) -> list[tuple[int, list[int]]]:
        if not self.config.draft_model:
            raise PlanError(f"step {plan.step_id}: asks for draft proposals, but this executor has no --draft-model")
        sampled: dict[int, list[int]] = {}
        for out in outputs:
            sampled.setdefault(out.seq_id, []).append(out.token_id)
        proposals = []
        for seq_id, count in plan.draft_requests:
            tokens = sampled.get(seq_id)
            if tokens is None or count < 1:
                raise PlanError(
                    f"step {plan.step_id}: asks for {count} proposals after seq {seq_id}, which sampled nothing"
                )
            proposals.append((seq_id, self._propose(self._known(seq_id), tokens, count)))
        return proposals

    def reset(self) -> None:
        """Forget every sequence; the shadow KV becomes garbage, as a real cache's would."""
        self.seqs.clear()
        self.shadow.reset()

    def close(self) -> None:
        self.seqs.clear()

    # --- inspection (tests) ------------------------------------------------------

    def shadow_tokens(self, seq_id: int) -> list[int]:
        """The computed tokens of a sequence as read back from the shadow KV."""
        seq = self._known(seq_id)
        return self.shadow.read_tokens(seq.block_table, 0, seq.num_computed)

    # --- plan application --------------------------------------------------------

    def _known(self, seq_id: int) -> _Sequence:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise PlanError(f"seq {seq_id}: unknown to the executor (never sent as new, or dropped)")
        return seq

    def _drop(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:  # dropping an unknown id is harmless (e.g. after a reset)
            self.shadow.release(seq.block_table)

    def _admit(
        self,
        seq_id: int,
        token_ids: list[int],
        prompt_len: int,
        num_computed: int,
        block_table: list[int],
        sampling: SamplingParams,
        seed: int,
    ) -> _Sequence:
        what = f"new seq {seq_id}"
        if seq_id in self.seqs:
            raise PlanError(f"{what}: already known; drop it first or send it as a cached sequence")
        if not 0 < prompt_len <= len(token_ids):
            raise PlanError(f"{what}: prompt_len {prompt_len} not in [1, {len(token_ids)}]")
        if not 0 <= num_computed <= len(token_ids):
            raise PlanError(f"{what}: num_computed_tokens {num_computed} not in [0, {len(token_ids)}]")
        self._check_tokens(token_ids, what)
        for block in block_table:
            self.shadow.check_block(block, what)
        if len(set(block_table)) != len(block_table):
            raise PlanError(f"{what}: block table {block_table} holds a block twice")
        seq = _Sequence(list(token_ids), prompt_len, list(block_table), sampling, seed, num_computed)
        if self._scripts is not None:
            seq.script = self._scripts.script(seq.token_ids[:prompt_len])
        self.shadow.check_covered(seq.block_table, num_computed, what)
        if num_computed:
            # Prefix-cache hit, copied block or swap-in: the KV must already hold these tokens.
            self.shadow.compare(seq.block_table, seq.token_ids, 0, num_computed, what, "already-computed")
        self.seqs[seq_id] = seq
        self.shadow.hold(seq.block_table)
        return seq

    def _trim(self, seq_id: int, num_blocks: int) -> None:
        seq = self._known(seq_id)
        if not 0 < num_blocks <= len(seq.block_table):
            raise PlanError(f"seq {seq_id}: trimmed to {num_blocks} blocks, but its table has {len(seq.block_table)}")
        self.shadow.release(seq.block_table[num_blocks:])
        del seq.block_table[num_blocks:]

    def _advance(self, seq_id: int, new_token_ids: list[int], num_computed: int, new_block_ids: list[int]) -> _Sequence:
        what = f"cached seq {seq_id}"
        seq = self._known(seq_id)
        if num_computed != seq.num_computed:
            raise PlanError(
                f"{what}: num_computed_tokens is {num_computed} but the executor computed {seq.num_computed}"
            )
        if seq.last_sampled is not None and new_token_ids and new_token_ids[0] != seq.last_sampled:
            raise PlanError(
                f"{what}: new_token_ids starts with {new_token_ids[0]} but the executor sampled {seq.last_sampled}"
            )
        self._check_tokens(new_token_ids, what)
        for block in new_block_ids:
            self.shadow.check_block(block, what)
            if block in seq.block_table:
                raise PlanError(f"{what}: new block {block} is already in its block table")
        seq.token_ids.extend(new_token_ids)
        seq.block_table.extend(new_block_ids)
        self.shadow.hold(new_block_ids)
        seq.last_sampled = None
        return seq

    def _check_tokens(self, token_ids: list[int], what: str) -> None:
        if token_ids and (min(token_ids) < 0 or (self.vocab.bounded and max(token_ids) >= self.vocab.size)):
            raise PlanError(f"{what}: token ids outside the vocabulary [0, {self.vocab.size})")

    def _write(self, seq_id: int, seq: _Sequence, num_scheduled: int) -> None:
        what = f"seq {seq_id}"
        start, end = seq.num_computed, seq.num_computed + num_scheduled
        tokens = seq.step_tokens()
        if num_scheduled < 0 or end > len(tokens):
            raise PlanError(f"{what}: schedules positions [{start}, {end}) but only {len(tokens)} tokens are known")
        if seq.drafts and end != len(tokens):
            raise PlanError(f"{what}: sends drafts but schedules positions [{start}, {end}) of {len(tokens)}")
        if end > self.max_model_len:
            raise PlanError(f"{what}: position {end - 1} exceeds max_model_len {self.max_model_len}")
        if num_scheduled == 0:
            if self.config.strict:
                raise PlanError(f"{what}: is in the plan but schedules no tokens")
            return
        self.shadow.write(seq.block_table, tokens, start, end, what)
        seq.num_computed = end

    # --- sampling ------------------------------------------------------------------

    def _verify(self, seq_id: int, seq: _Sequence, masks: list[bytes] | None) -> list[SampledToken]:
        """Draw at every draft position as plain decoding would there (under that position's mask); keep
        the draws up to the first miss."""
        known, drafts = seq.token_ids, seq.drafts
        outputs: list[SampledToken] = []
        for j in range(len(drafts) + 1):
            out = self._sample(seq_id, seq, known + drafts[:j], masks[j] if masks else None)
            outputs.append(out)
            if j == len(drafts) or out.token_id != drafts[j]:
                break
        seq.num_computed = len(known) + len(outputs) - 1  # the KV of rejected drafts is garbage now
        seq.last_sampled = outputs[0].token_id
        return outputs

    def _sample(self, seq_id: int, seq: _Sequence, context: list[int], mask: bytes | None) -> SampledToken:
        length = len(context)
        window = self.shadow.compare(
            seq.block_table,
            context,
            max(0, length - self.config.context_window),
            length,
            f"seq {seq_id}",
            "context",
        )
        token, h = self._draw(seq, context, window, mask)
        seq.last_sampled = token
        out = SampledToken(seq_id=seq_id, token_id=token)
        if seq.sampling.logprobs is not None:
            out.logprob = fake_logprob(h)
            out.top_logprobs = top_logprobs(h, token, out.logprob, seq.sampling.logprobs, self.vocab.samplable)
        return out

    def _draw(self, seq: _Sequence, context: list[int], window: list[int], mask: bytes | None) -> tuple[int, int]:
        """(the token that follows `context`, the draw's hash): a function of the context's last
        tokens (`window`), its length and, when sampling, the seed."""
        length = len(context)
        greedy = seq.sampling.temperature == 0.0
        h = context_hash(window, length, seq.seed, greedy)
        may_end = self._may_end_by_eos(seq, length - seq.prompt_len) and wants_eos(h, self.config.eos_probability)
        if seq.script is not None or (mask is not None and self.config.fault_violate_token_masks):
            chosen = self._test_draw(seq, length, h, mask)
            if chosen is not None:
                return chosen, h
        allowed = None
        if mask is None:
            token = self.vocab.eos_token_ids[0] if may_end else None
            if token is None and copies(h, greedy):
                token = copied_token(context, self.config.copy_period, self._samplable_set)
            if token is None:
                token = pick_token(h, self.vocab.samplable)
        else:
            allowed = allowed_token_ids(mask)
            eos = next((t for t in self.vocab.eos_token_ids if t in allowed), None)
            token = eos if may_end and eos is not None else pick_allowed(h, allowed, self._samplable_set)
        if seq.sampling.logit_bias:
            held_back = (
                frozenset()
                if stop_tokens_allowed(seq.sampling, length - seq.prompt_len)
                else stop_token_ids(seq.sampling, self.vocab.eos_token_ids)
            )
            within = None if allowed is None else frozenset(allowed)
            fallback = self.vocab.samplable if allowed is None else allowed
            token = biased_token(token, h, seq.sampling.logit_bias, within, fallback, held_back)
        return token, h

    def _test_draw(self, seq: _Sequence, length: int, h: int, mask: bytes | None) -> int | None:
        """What the tests' options draw instead of the fake model, None where they leave the draw alone: a
        token the mask forbids (`--fault-violate-token-masks`), else the scripted reply's next token, or eos
        after its last, as far as the mask allows (`--scripted-replies`)."""
        allowed = None if mask is None else allowed_token_ids(mask)
        if allowed is not None and self.config.fault_violate_token_masks:
            forbidden = forbidden_token(h, allowed, self.vocab.samplable)
            if forbidden is not None:
                return forbidden
        if seq.script is None:
            return None
        position = length - seq.prompt_len
        if position < len(seq.script):
            token = seq.script[position]
        elif self._may_end_by_eos(seq, position):
            token = self.vocab.eos_token_ids[0]
        else:
            return None
        return token if allowed is None or token in allowed else None

    def _propose(self, seq: _Sequence, sampled: list[int], count: int) -> list[int]:
        """A fake draft model's proposals after this step's `sampled` tokens: the tokens this fake model
        would draw next, each wrong on purpose one time in four (by a hash of its context), so every
        accept length occurs."""
        context = seq.token_ids + sampled
        proposals: list[int] = []
        for _ in range(count):
            token, h = self._draw(seq, context, context[-self.config.context_window :], None)
            if hash_ints([h], 0xD4AF7, 0) % 4 == 0:
                token = pick_token(h >> 7, self.vocab.samplable)
            proposals.append(token)
            context = context + [token]
        return proposals

    def _may_end_by_eos(self, seq: _Sequence, num_output_before: int) -> bool:
        """eos may come only as the shared stop rules allow: not ignored, min_tokens reached."""
        return (
            bool(self.vocab.eos_token_ids)
            and not seq.sampling.ignore_eos
            and stop_tokens_allowed(seq.sampling, num_output_before)
        )


def _mask_rows(plan: StepPlan) -> dict[int, list[bytes]]:
    """Each constrained sequence's mask rows (structured output), by sequence id: one per sampled
    position, in order (several when it verifies drafts)."""
    width = plan.mask_row_bytes
    masks = plan.token_masks
    rows: dict[int, list[bytes]] = {}
    for i, seq_id in enumerate(plan.mask_seq_ids):
        rows.setdefault(seq_id, []).append(masks[i * width : (i + 1) * width])
    return rows


__all__ = ["FakeExecutor", "FakeExecutorConfig", "PlanError"]
