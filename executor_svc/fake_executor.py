"""An executor without a model: deterministic tokens, a shadow KV cache, strict plan checks.

It exists so scheduler, API and reliability tests run fast, and so they catch scheduler
bugs a real model would hide behind plausible-looking text:

- a *shadow KV cache* (`num_blocks * block_size` int slots, plus the CPU swap space)
  receives every computed token's id at its slot
  `block_table[pos // block_size] * block_size + pos % block_size`; swaps and copies move
  slots exactly as they would move K/V;
- the next token is a hash of the last few context tokens *read back from the slots
  through the block table*, the context length and (when sampling) the seed. A wrong
  block table, a stale prefix hit or a bad copy therefore changes the output, and the
  read-back is also compared with the plan's tokens so it fails loudly with `PlanError`;
- every plan is checked the way a careful executor would: known / unknown sequence ids,
  positions covered by the block table, block ids in range, no write into a block that
  another live sequence shares, copies and swap-ins only into unowned blocks,
  `num_computed_tokens` in step with what was computed, and `new_token_ids` starting
  with the token sampled last step.

Tokens depend only on the context and the seed, never on the batch, so recompute after
preemption, swap and executor restarts reproduce outputs exactly. No torch import.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from protos import defaults
from protos.sampling import SamplingParams
from protos.step import ExecutorInfo, SampledToken, StepPlan, StepResult, TokenLogprob

log = structlog.get_logger(__name__)

EMPTY_SLOT = -1
_MASK64 = (1 << 64) - 1


class PlanError(ValueError):
    """The plan breaks the step contract: a scheduler bug."""


@dataclass(slots=True)
class FakeExecutorConfig:
    num_blocks: int = 8192
    block_size: int = defaults.BLOCK_SIZE
    num_cpu_blocks: int = 0
    max_model_len: int | None = None
    """None: the tokenizer dir's config.json max_position_embeddings, else 8192."""
    vocab_size: int | None = None
    """None: config.json vocab_size, else the size of tokenizer.json's vocabulary."""
    tokenizer_path: str | None = None
    """None: the default model's directory (executor_svc.model_store.ensure_model_dir)."""
    step_latency_ms: float = 0.0
    """Each step takes at least this long, like a real forward pass."""
    eos_probability: float = 0.0
    """Chance (deterministic per context) that a sampled token is eos; 0 never ends by eos."""
    context_window: int = 4
    """How many trailing context tokens the next token depends on."""
    model_id: str | None = None


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


@dataclass(slots=True)
class _Vocabulary:
    size: int
    eos_token_ids: list[int]
    samplable: list[int]
    """Token ids the fake may emit: every id except special tokens and eos."""
    max_position_embeddings: int | None = None
    name: str = "fake"


class FakeExecutor:
    """`executor_svc.protocol.Executor` with a shadow KV cache instead of a model."""

    def __init__(self, config: FakeExecutorConfig | None = None) -> None:
        self.config = config = config or FakeExecutorConfig()
        if config.num_blocks < 1 or config.block_size < 1 or config.num_cpu_blocks < 0:
            raise ValueError("num_blocks and block_size must be positive, num_cpu_blocks non-negative")
        tokenizer_dir = Path(config.tokenizer_path) if config.tokenizer_path else _default_model_dir()
        self.tokenizer_path = str(tokenizer_dir)
        self.vocab = _load_vocabulary(tokenizer_dir, config.vocab_size)
        self.max_model_len = config.max_model_len or self.vocab.max_position_embeddings or 8192
        # Plain lists: a decode step touches one slot per sequence, where Python indexing
        # beats numpy's per-call overhead by an order of magnitude.
        self.kv: list[int] = []
        self.cpu_kv: list[int] = []
        self.block_refs: list[int] = []
        """How many live block tables hold each device block."""
        self.seqs: dict[int, _Sequence] = {}
        self.steps = 0
        self.reset()

    # --- Executor protocol -------------------------------------------------------

    def info(self) -> ExecutorInfo:
        cfg = self.config
        return ExecutorInfo(
            model_id=cfg.model_id or f"fake:{self.vocab.name}",
            num_blocks=cfg.num_blocks, block_size=cfg.block_size, num_cpu_blocks=cfg.num_cpu_blocks,
            vocab_size=self.vocab.size, max_model_len=self.max_model_len,
            eos_token_ids=list(self.vocab.eos_token_ids), tokenizer_path=self.tokenizer_path,
            executor_kind="fake", device="cpu", dtype="none", attention_backend="none",
        )

    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        for seq_id in plan.drop_seq_ids:
            self._drop(seq_id)
        self._swap_out(plan.swap_out)
        self._swap_in(plan.swap_in)
        self._copy(plan.copies)
        scheduled: list[tuple[int, _Sequence, int]] = []
        for new in plan.new_seqs:
            seq = self._admit(new.seq_id, new.token_ids, new.prompt_len, new.num_computed_tokens,
                              new.block_table, new.sampling, new.seed)
            scheduled.append((new.seq_id, seq, new.num_scheduled_tokens))
        for cached in plan.known_seqs:
            seq = self._advance(cached.seq_id, cached.new_token_ids, cached.num_computed_tokens,
                                cached.new_block_ids)
            scheduled.append((cached.seq_id, seq, cached.num_scheduled_tokens))
        if len({seq_id for seq_id, _, _ in scheduled}) != len(scheduled):
            raise PlanError(f"step {plan.step_id}: a sequence appears twice in the plan")
        outputs = []
        for seq_id, seq, num_scheduled in scheduled:
            self._write(seq_id, seq, num_scheduled)
            if num_scheduled > 0 and seq.num_computed == len(seq.token_ids):
                outputs.append(self._sample(seq_id, seq))
        self.steps += 1
        latency = self.config.step_latency_ms / 1000.0
        elapsed = time.perf_counter() - started
        if latency > elapsed:
            time.sleep(latency - elapsed)
        return StepResult(step_id=plan.step_id, outputs=outputs, execute_time_s=time.perf_counter() - started)

    def reset(self) -> None:
        """Forget every sequence; the shadow KV becomes garbage, as a real cache's would."""
        cfg = self.config
        self.seqs.clear()
        self.block_refs = [0] * cfg.num_blocks
        self.kv = [EMPTY_SLOT] * (cfg.num_blocks * cfg.block_size)
        self.cpu_kv = [EMPTY_SLOT] * (cfg.num_cpu_blocks * cfg.block_size)

    def close(self) -> None:
        self.seqs.clear()

    # --- inspection (tests) ------------------------------------------------------

    def shadow_tokens(self, seq_id: int) -> list[int]:
        """The computed tokens of a sequence as read back from the shadow KV."""
        seq = self._known(seq_id)
        return self._read(seq, 0, seq.num_computed)

    # --- plan application --------------------------------------------------------

    def _known(self, seq_id: int) -> _Sequence:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise PlanError(f"seq {seq_id}: unknown to the executor (never sent as new, or dropped)")
        return seq

    def _drop(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:  # dropping an unknown id is harmless (e.g. after a reset)
            refs = self.block_refs
            for block in seq.block_table:
                refs[block] -= 1

    def _check_block(self, block: int, what: str) -> None:
        if not 0 <= block < self.config.num_blocks:
            raise PlanError(f"{what}: device block {block} is outside [0, {self.config.num_blocks})")

    def _check_cpu_block(self, block: int, what: str) -> None:
        if not 0 <= block < self.config.num_cpu_blocks:
            raise PlanError(f"{what}: CPU block {block} is outside [0, {self.config.num_cpu_blocks})")

    def _check_unowned(self, block: int, what: str) -> None:
        if self.block_refs[block]:
            raise PlanError(f"{what}: block {block} belongs to {self.block_refs[block]} live sequence(s) "
                            "and would be overwritten")

    def _swap_out(self, pairs: list[tuple[int, int]]) -> None:
        bs = self.config.block_size
        for device, cpu in pairs:
            self._check_block(device, "swap_out")
            self._check_cpu_block(cpu, "swap_out")
            self.cpu_kv[cpu * bs:(cpu + 1) * bs] = self.kv[device * bs:(device + 1) * bs]

    def _swap_in(self, pairs: list[tuple[int, int]]) -> None:
        bs = self.config.block_size
        for cpu, device in pairs:
            self._check_cpu_block(cpu, "swap_in")
            self._check_block(device, "swap_in")
            self._check_unowned(device, "swap_in")
            self.kv[device * bs:(device + 1) * bs] = self.cpu_kv[cpu * bs:(cpu + 1) * bs]

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        bs = self.config.block_size
        for src, dst in pairs:
            self._check_block(src, "copy")
            self._check_block(dst, "copy")
            self._check_unowned(dst, "copy")
            self.kv[dst * bs:(dst + 1) * bs] = self.kv[src * bs:(src + 1) * bs]

    def _admit(self, seq_id: int, token_ids: list[int], prompt_len: int, num_computed: int,
               block_table: list[int], sampling: SamplingParams, seed: int) -> _Sequence:
        what = f"new seq {seq_id}"
        if seq_id in self.seqs:
            raise PlanError(f"{what}: already known; drop it first or send it as a cached sequence")
        if not 0 < prompt_len <= len(token_ids):
            raise PlanError(f"{what}: prompt_len {prompt_len} not in [1, {len(token_ids)}]")
        if not 0 <= num_computed <= len(token_ids):
            raise PlanError(f"{what}: num_computed_tokens {num_computed} not in [0, {len(token_ids)}]")
        self._check_tokens(token_ids, what)
        for block in block_table:
            self._check_block(block, what)
        if len(set(block_table)) != len(block_table):
            raise PlanError(f"{what}: block table {block_table} holds a block twice")
        seq = _Sequence(list(token_ids), prompt_len, list(block_table), sampling, seed, num_computed)
        self._check_covered(seq, num_computed, what)
        if num_computed:
            # Prefix-cache hit, copied block or swap-in: the KV must already hold these tokens.
            self._compare(seq, 0, num_computed, what, "already-computed")
        self.seqs[seq_id] = seq
        refs = self.block_refs
        for block in seq.block_table:
            refs[block] += 1
        return seq

    def _advance(self, seq_id: int, new_token_ids: list[int], num_computed: int,
                 new_block_ids: list[int]) -> _Sequence:
        what = f"cached seq {seq_id}"
        seq = self._known(seq_id)
        if num_computed != seq.num_computed:
            raise PlanError(f"{what}: num_computed_tokens is {num_computed} but the executor computed "
                            f"{seq.num_computed}")
        if seq.last_sampled is not None and new_token_ids and new_token_ids[0] != seq.last_sampled:
            raise PlanError(f"{what}: new_token_ids starts with {new_token_ids[0]} but the executor "
                            f"sampled {seq.last_sampled}")
        self._check_tokens(new_token_ids, what)
        for block in new_block_ids:
            self._check_block(block, what)
            if block in seq.block_table:
                raise PlanError(f"{what}: new block {block} is already in its block table")
        seq.token_ids.extend(new_token_ids)
        seq.block_table.extend(new_block_ids)
        for block in new_block_ids:
            self.block_refs[block] += 1
        seq.last_sampled = None
        return seq

    def _check_tokens(self, token_ids: list[int], what: str) -> None:
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= self.vocab.size):
            raise PlanError(f"{what}: token ids outside the vocabulary [0, {self.vocab.size})")

    def _check_covered(self, seq: _Sequence, end: int, what: str) -> None:
        if end > len(seq.block_table) * self.config.block_size:
            raise PlanError(f"{what}: position {end - 1} is beyond its block table "
                            f"({len(seq.block_table)} blocks of {self.config.block_size})")

    def _write(self, seq_id: int, seq: _Sequence, num_scheduled: int) -> None:
        what = f"seq {seq_id}"
        start, end = seq.num_computed, seq.num_computed + num_scheduled
        if num_scheduled < 0 or end > len(seq.token_ids):
            raise PlanError(f"{what}: schedules positions [{start}, {end}) but only {len(seq.token_ids)} "
                            "tokens are known")
        if end > self.max_model_len:
            raise PlanError(f"{what}: position {end - 1} exceeds max_model_len {self.max_model_len}")
        if num_scheduled == 0:
            return
        self._check_covered(seq, end, what)
        bs = self.config.block_size
        table = seq.block_table
        for index in range(start // bs, (end - 1) // bs + 1):
            if self.block_refs[table[index]] > 1:
                raise PlanError(f"{what}: writes positions into block {table[index]}, which "
                                f"{self.block_refs[table[index]]} sequences share (missing copy-on-write)")
        kv = self.kv
        tokens = seq.token_ids
        for pos, slot in zip(range(start, end), self._slots(table, start, end)):
            kv[slot] = tokens[pos]
        seq.num_computed = end

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.config.block_size
        return [table[pos // bs] * bs + pos % bs for pos in range(start, end)]

    def _read(self, seq: _Sequence, start: int, end: int) -> list[int]:
        kv = self.kv
        return [kv[slot] for slot in self._slots(seq.block_table, start, end)]

    def _compare(self, seq: _Sequence, start: int, end: int, what: str, role: str) -> list[int]:
        stored = self._read(seq, start, end)
        expected = seq.token_ids[start:end]
        if stored != expected:
            offset = next(i for i, (a, b) in enumerate(zip(stored, expected)) if a != b)
            pos, held = start + offset, stored[offset]
            raise PlanError(
                f"{what}: KV at position {pos} (block {seq.block_table[pos // self.config.block_size]}) "
                f"holds {'nothing' if held == EMPTY_SLOT else f'token {held}'} but the {role} token is "
                f"{expected[offset]}: wrong block table, stale prefix hit or bad copy/swap"
            )
        return stored

    # --- sampling ------------------------------------------------------------------

    def _sample(self, seq_id: int, seq: _Sequence) -> SampledToken:
        length = len(seq.token_ids)
        window = self._compare(seq, max(0, length - self.config.context_window), length,
                               f"seq {seq_id}", "context")
        greedy = seq.sampling.temperature == 0.0
        h = _hash_ints(window, length, 0 if greedy else seq.seed + 1)
        output_pos = length - seq.prompt_len
        token = self.vocab.samplable[h % len(self.vocab.samplable)]
        if self._wants_eos(h, seq, output_pos):
            token = self.vocab.eos_token_ids[0]
        seq.last_sampled = token
        out = SampledToken(seq_id=seq_id, token_id=token)
        if seq.sampling.logprobs is not None:
            out.logprob = _fake_logprob(h)
            out.top_logprobs = self._top_logprobs(h, token, out.logprob, seq.sampling.logprobs)
        return out

    def _wants_eos(self, h: int, seq: _Sequence, output_pos: int) -> bool:
        p = self.config.eos_probability
        if p <= 0.0 or not self.vocab.eos_token_ids or seq.sampling.ignore_eos:
            return False
        if output_pos < seq.sampling.min_tokens:
            return False
        return _hash_ints([h], 0x5EED, 0) % 1_000_000 < p * 1_000_000

    def _top_logprobs(self, h: int, token: int, logprob: float, k: int) -> list[TokenLogprob]:
        """The sampled token first, then k-1 made-up alternatives with lower logprobs."""
        if k <= 0:
            return []
        top = [TokenLogprob(token, logprob)]
        samplable = self.vocab.samplable
        for i in range(1, k):
            alt = samplable[_hash_ints([h, i], 0, 0) % len(samplable)]
            top.append(TokenLogprob(alt, logprob - 0.5 * i))
        return top


# --- module internals ---------------------------------------------------------------

def _hash_ints(values: list[int], length: int, salt: int) -> int:
    """A 64-bit mix (splitmix64 finalizer per value): stable across processes and platforms."""
    h = (length * 0x9E3779B97F4A7C15 + salt) & _MASK64
    for v in values:
        h = (h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 31
    return h


def _fake_logprob(h: int) -> float:
    return -0.001 - ((h >> 17) % 4000) / 1000.0  # in (-4.001, -0.001]


def _default_model_dir() -> Path:
    from executor_svc.model_store import ensure_model_dir  # no torch when already converted

    return ensure_model_dir()


def _load_vocabulary(model_dir: Path, vocab_size: int | None) -> _Vocabulary:
    """Vocabulary size, eos ids and special ids from config.json / tokenizer.json, no tokenizer library."""
    config: dict = {}
    if (model_dir / "config.json").is_file():
        config = json.loads((model_dir / "config.json").read_text())
    special: set[int] = set()
    tokenizer_vocab = 0
    if (model_dir / "tokenizer.json").is_file():
        tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
        special = {t["id"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
        tokenizer_vocab = max([len(tokenizer.get("model", {}).get("vocab", {})), *(i + 1 for i in special)],
                              default=0)
    size = vocab_size or config.get("vocab_size") or tokenizer_vocab
    if not size:
        raise ValueError(f"{model_dir}: no vocab_size in config.json or tokenizer.json; pass vocab_size")
    eos = _eos_ids(config, model_dir)
    excluded = special | set(eos)
    samplable = [i for i in range(size) if i not in excluded]
    if not samplable:
        raise ValueError("the vocabulary has no ordinary tokens to sample")
    return _Vocabulary(size=int(size), eos_token_ids=[e for e in eos if e < size], samplable=samplable,
                       max_position_embeddings=config.get("max_position_embeddings"), name=model_dir.name)


def _eos_ids(config: dict, model_dir: Path) -> list[int]:
    sources = [config.get("eos_token_id")]
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        sources.append(json.loads(generation.read_text()).get("eos_token_id"))
    ids: list[int] = []
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids


__all__ = ["FakeExecutor", "FakeExecutorConfig", "PlanError"]
