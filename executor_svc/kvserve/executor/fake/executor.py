"""An executor without a model: deterministic tokens, a shadow KV cache, strict plan checks.

It exists so scheduler, API and reliability tests run fast, and so they catch scheduler
bugs a real model would hide behind plausible-looking text:

- a *shadow KV cache* (`kvserve.executor.fake.shadow_kv`: one slot per token, plus the CPU swap
  space) receives every computed token's id at its slot
  `block_table[pos // block_size] * block_size + pos % block_size`; swaps and copies move
  slots exactly as they would move K/V;
- the next token (`kvserve.executor.fake.fake_model`, over `kvserve.executor.fake.tokens`) is a
  hash of the last few context tokens *read back from the slots through the block table*, the
  context length and (when sampling) the seed. A wrong block table, a stale prefix hit or a bad
  copy therefore changes the output, and the read-back is also compared with the plan's tokens
  so it fails loudly with `PlanError`;
- every plan is checked the way a careful executor would (the sequence deltas in
  `kvserve.executor.fake.sequences`, block moves in the shadow KV): known / unknown sequence ids,
  positions covered by the block table, block ids in range, no write into a block that
  another live sequence shares, copies and swap-ins only into unowned blocks,
  `num_computed_tokens` in step with what was computed, and `new_token_ids` starting
  with the token sampled last step.

Strict mode (`FakeExecutorConfig.strict`, for the scheduler's own tests) checks more at
a cost: slots hold (token id, position), every scheduled sequence's whole context is
read back after the forward pass, and block moves and empty schedules are refused.

Tokens depend only on the context, the seed and the sequence's LoRA adapter (`--lora NAME=PATH`,
a salt of the draw: `kvserve.executor.fake.adapters`), never on the batch, so recompute after
preemption, swap and executor restarts reproduce outputs exactly. A structured-output
mask restricts the draw to the tokens it allows (ordinary ones first), so `choice` and
fixed-string regexes come out whole. `logit_bias` is honoured simply (`tokens.biased_token`):
the allowed token with the highest positive bias is picked (lowest id on a tie), and a banned
(-100) token is never picked. No torch import.

This module holds the executor itself: its config (each field a flag) and `FakeExecutor`, which
applies a plan in its order (drops, trims, block moves, sequence deltas, the forward pass's writes,
then the samples, draft verification and proposals).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.config import defaults
from kvserve.config.flags import flag
from kvserve.executor.config_error import ExecutorConfigError
from kvserve.executor.fake.adapters import lora_names
from kvserve.executor.fake.fake_model import FakeModel
from kvserve.executor.fake.scripted_reply import ScriptedReplies
from kvserve.executor.fake.sequences import FakeSequence, SequenceTable
from kvserve.executor.fake.shadow_kv import ShadowKV
from kvserve.executor.fake.tokens import DEFAULT_CONTEXT_WINDOW, fake_logprob, top_logprobs
from kvserve.executor.fake.vocabulary import default_model_dir, load_vocabulary, plain_vocabulary
from kvserve.executor.kv_tier.plan_blocks import BlockTiers, run_tier_ops
from kvserve.protos.step import ExecutorInfo, PlanError, SampledToken, StepPlan, StepResult


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
    lora: tuple[str, ...] = ()
    """From the runner's --lora NAME=PATH: the adapters it reports (`ExecutorInfo.lora_names`), loading
    nothing (PATH need not exist); a sequence's tokens depend on its adapter's name (`adapters.lora_salt`)."""
    kv_host_gb: float = defaults.KV_HOST_GB
    """From the runner's --kv-host-gb: the host-memory tier, holding each block's token slots as the fake's KV."""
    kv_disk_dir: str | None = None
    """From the runner's --kv-disk-dir: the disk tier, holding each block's token slots as the fake's KV."""
    kv_disk_gb: float = defaults.KV_DISK_GB
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
        self.lora_names = lora_names(config.lora)
        self.shadow = ShadowKV(config.num_blocks, config.block_size, config.num_cpu_blocks, strict=config.strict)
        scripts = ScriptedReplies(self.tokenizer_path) if config.scripted_replies else None
        self.sequences = SequenceTable(
            self.shadow, self.vocab, self.max_model_len, strict=config.strict, scripts=scripts, loras=self.lora_names
        )
        self.model = FakeModel(
            self.vocab,
            context_window=config.context_window,
            eos_probability=config.eos_probability,
            copy_period=config.copy_period,
            fault_violate_token_masks=config.fault_violate_token_masks,
        )
        self.steps = 0
        self.tiers: BlockTiers | None = None
        """The prefix cache's tiers below the pool (--kv-host-gb, --kv-disk-dir): each block's token slots,
        as the real one's KV."""
        self.disk_fingerprint = ""
        if BlockTiers.asked_for(config.kv_host_gb, config.kv_disk_dir):
            self.disk_fingerprint = f"fake|{self.info_model_id()}|block_size={config.block_size}|strict={config.strict}"
            self.tiers = BlockTiers.open(
                config.kv_host_gb, config.kv_disk_dir, config.kv_disk_gb, self.disk_fingerprint
            )

    def info_model_id(self) -> str:
        return self.config.model_id or f"fake:{self.vocab.name}"

    @property
    def seqs(self) -> dict[int, FakeSequence]:
        """The sequences this executor knows, by id (tests read a sequence's state here)."""
        return self.sequences.by_id

    # --- Executor protocol -------------------------------------------------------

    def info(self) -> ExecutorInfo:
        cfg = self.config
        return ExecutorInfo(
            model_id=self.info_model_id(),
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
            lora_names=list(self.lora_names),
            kv_fingerprint=self.disk_fingerprint,
            kv_disk_keys=self.tiers.keys() if self.tiers is not None else [],
            kv_block_bytes=self.shadow.block_payload_bytes,
            kv_tiers=self.tiers.media() if self.tiers is not None else [],
        )

    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        for seq_id in plan.drop_seq_ids:
            self.sequences.drop(seq_id)
        for seq_id, num_blocks in plan.trims:
            self.sequences.trim(seq_id, num_blocks)
        # After the drops (they write no KV, and free blocks a load may fill), before any block move.
        tier_ops = run_tier_ops(plan, self.tiers, self.shadow)
        self.shadow.swap_out(plan.swap_out)
        self.shadow.swap_in(plan.swap_in)
        self.shadow.copy(plan.copies)
        scheduled: list[tuple[int, FakeSequence, int]] = []
        for new in plan.new_seqs:
            seq = self.sequences.admit(
                new.seq_id,
                new.token_ids,
                new.prompt_len,
                new.num_computed_tokens,
                new.block_table,
                new.sampling,
                new.seed,
                new.lora_name,
            )
            scheduled.append((new.seq_id, seq, new.num_scheduled_tokens))
        for cached in plan.known_seqs:
            seq = self.sequences.advance(
                cached.seq_id, cached.new_token_ids, cached.num_computed_tokens, cached.new_block_ids
            )
            self.sequences.check_tokens(cached.draft_token_ids, f"cached seq {cached.seq_id}'s drafts")
            seq.drafts = cached.draft_token_ids
            scheduled.append((cached.seq_id, seq, cached.num_scheduled_tokens))
        if len({seq_id for seq_id, _, _ in scheduled}) != len(scheduled):
            raise PlanError(f"step {plan.step_id}: a sequence appears twice in the plan")
        for seq_id, seq, num_scheduled in scheduled:  # the forward pass writes every token first
            self.sequences.write(seq_id, seq, num_scheduled)
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
            step_id=plan.step_id,
            outputs=outputs,
            execute_time_s=time.perf_counter() - started,
            proposals=proposals,
            failed_load_blocks=tier_ops.failed,
            disk_load_blocks=tier_ops.from_disk,
            dropped_keys=tier_ops.dropped,
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
            proposals.append((seq_id, self.model.propose(self.sequences.known(seq_id), tokens, count)))
        return proposals

    def reset(self) -> None:
        """Forget every sequence; the shadow KV becomes garbage, as a real cache's would."""
        self.sequences.clear()
        self.shadow.reset()

    def load_adapter(self, name: str, path: str) -> list[str]:
        """Take `name` as an adapter (PATH is not read: the fake loads nothing), by the real rules for names."""
        del path
        if name in self.lora_names:
            raise ExecutorConfigError(f"LoRA adapter {name!r}: the name is taken by a loaded adapter")
        self._set_loras((*self.lora_names, name))
        return list(self.lora_names)

    def unload_adapter(self, name: str) -> list[str]:
        if name not in self.lora_names:
            raise ExecutorConfigError(f"LoRA adapter {name!r} is not loaded")
        self._set_loras(tuple(n for n in self.lora_names if n != name))
        return list(self.lora_names)

    def _set_loras(self, names: tuple[str, ...]) -> None:
        self.lora_names = names
        self.sequences.loras = frozenset(names)

    def close(self) -> None:
        self.sequences.clear()
        if self.tiers is not None:
            self.tiers.close()

    # --- inspection (tests) ------------------------------------------------------

    def shadow_tokens(self, seq_id: int) -> list[int]:
        """The computed tokens of a sequence as read back from the shadow KV."""
        seq = self.sequences.known(seq_id)
        return self.shadow.read_tokens(seq.block_table, 0, seq.num_computed)

    # --- sampling ------------------------------------------------------------------

    def _verify(self, seq_id: int, seq: FakeSequence, masks: list[bytes] | None) -> list[SampledToken]:
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

    def _sample(self, seq_id: int, seq: FakeSequence, context: list[int], mask: bytes | None) -> SampledToken:
        """The fake model's draw after `context`, whose last tokens are read back through the block table."""
        length = len(context)
        window = self.shadow.compare(
            seq.block_table,
            context,
            max(0, length - self.config.context_window),
            length,
            f"seq {seq_id}",
            "context",
        )
        token, h = self.model.draw(seq, context, window, mask)
        seq.last_sampled = token
        out = SampledToken(seq_id=seq_id, token_id=token)
        if seq.sampling.logprobs is not None:
            out.logprob = fake_logprob(h)
            out.top_logprobs = top_logprobs(h, token, out.logprob, seq.sampling.logprobs, self.vocab.samplable)
        return out


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
