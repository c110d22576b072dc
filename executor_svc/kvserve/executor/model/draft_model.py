"""Speculative decoding's draft model (`--draft-model`): a smaller model proposing the next tokens.

It shares the served model's tokenizer (its vocabulary must be the same) and its block tables:
its own KV cache has the same blocks, so every slot the scheduler assigns holds the served
model's K/V in one cache and the draft's in the other. Prefix sharing, copy-on-write and swaps
move both alike, an executor restart loses both, and the scheduler keeps no state for it.

- **Catch-up.** Every step it runs on the tokens the served model runs on, so its cache never
  lags: a prefix-cache hit or a recompute finds the draft's K/V where the served model's is.
- **Proposals.** For the sequences the plan asks (`StepPlan.draft_requests`), after sampling it
  decodes greedily from the token just sampled, one row per sequence and one token per pass.
  Its drafts are a point mass, so verification keeps the served model's distribution exactly
  and a seeded request gives the same tokens with speculation on or off.
- **Scratch blocks.** Those passes write K/V past what the scheduler allocated (the next step
  will hold those tokens, not this one). Positions beyond a sequence's table go to blocks past
  the pool's, which no plan names; positions inside it are the sequence's own unshared tail.
  The next step's catch-up rewrites every position before anything reads it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from kvserve.executor.attention.base import AttentionBackend
from kvserve.executor.config_error import ExecutorConfigError
from kvserve.executor.model.input_batch import InputBatch, build_input_batch
from kvserve.executor.model.kv_cache import CacheGeometry, PagedKVCache
from kvserve.executor.model.llama import LlamaModel
from kvserve.executor.model_config import ModelConfig, load_model_config
from kvserve.executor.sequence_state import SequenceState
from kvserve.executor.weights import model_store
from kvserve.executor.weights.loader import load_weights
from kvserve.protos.step import PlanError, SampledToken

log = structlog.get_logger(__name__)

SCRATCH_BLOCKS = 64
"""Blocks past the pool for proposals' K/V: two per proposing sequence (a proposal of up to a
block's worth of tokens spans at most two), so up to 32 sequences propose in one step."""


@dataclass(slots=True)
class DraftModelSpec:
    """What the draft model is loaded for: the served model's shape it must fit."""

    source: str
    weights: str
    """The served model's weights kind: a native target drafts natively where the draft's file allows,
    so drafting with the served model itself computes what it serves (one arithmetic, not two)."""
    vocab_size: int
    block_size: int
    kv_dtype: torch.dtype
    kv_layout: str
    max_model_len: int


class DraftModel:
    """The draft model, its KV cache over the served model's block ids, and its proposals."""

    def __init__(
        self,
        spec: DraftModelSpec,
        device: str,
        dtype: torch.dtype,
        silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """`silu_mul`: the served model's SwiGLU activation, so a draft that is the served model computes
        what it serves."""
        started = time.monotonic()
        self.spec = spec
        self.device = device
        self.dtype = dtype
        self.model_dir = model_store.ensure_model_dir(spec.source)
        self.config: ModelConfig = load_model_config(self.model_dir)
        if self.config.vocab_size != spec.vocab_size:
            raise ExecutorConfigError(
                f"--draft-model {spec.source}: its vocabulary has {self.config.vocab_size} tokens, the served "
                f"model's {spec.vocab_size}; a draft model must share the served model's tokenizer"
            )
        native = None
        if spec.weights == "native":
            from kvserve.executor.weights.gguf_weights import native_linears_or_none  # reads `gguf` lazily

            native = native_linears_or_none(spec.source, self.config, required=False)
        weights = load_weights(self.model_dir, self.config, device, dtype, native, q8_lm_head=bool(native))
        self.model = LlamaModel(self.config, weights, spec.max_model_len, device, dtype, silu_mul=silu_mul)
        self.geometry = CacheGeometry(
            self.config.num_layers,
            self.config.num_kv_heads,
            self.config.head_dim,
            spec.block_size,
            spec.kv_dtype,
            layout=spec.kv_layout,
        )
        self.cache: PagedKVCache | None = None
        self.num_blocks = 0
        self.load_seconds = time.monotonic() - started

    @property
    def model_id(self) -> str:
        return self.model_dir.name

    def allocate(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Its cache: the pool's blocks (same ids as the served model's), CPU swap and the scratch blocks."""
        self.num_blocks = num_blocks
        self.cache = PagedKVCache(self.geometry, num_blocks + SCRATCH_BLOCKS, num_cpu_blocks, self.device)

    # --- every step ----------------------------------------------------------------

    def block_ops(
        self, copies: list[tuple[int, int]], swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]
    ) -> None:
        """The plan's block operations, as the served model's cache applies them."""
        cache = self._cache()
        cache.swap_out(swap_out)
        cache.swap_in(swap_in)
        cache.copy_blocks(copies)

    def catch_up(self, seqs: list[SequenceState], backend: AttentionBackend) -> None:
        """Write the draft's K/V for every token this step computes (no logits)."""
        batch = self._batch(seqs)
        batch.sample_indices = batch.sample_indices[:0]
        self.model.forward(batch, self._cache(), backend)

    def propose(
        self,
        seqs: list[SequenceState],
        outputs: list[SampledToken],
        requests: list[tuple[int, int]],
        backend: AttentionBackend,
    ) -> list[tuple[int, list[int]]]:
        """Greedy proposals to follow each requested sequence's tokens as this step left them."""
        by_id = {seq.seq_id: seq for seq in seqs}
        sampled: dict[int, list[int]] = {}
        for out in outputs:
            sampled.setdefault(out.seq_id, []).append(out.token_id)
        rows: list[SequenceState] = []
        counts: list[int] = []
        scratch = self.num_blocks
        bs = self.spec.block_size
        for seq_id, count in requests:
            seq, tokens = by_id.get(seq_id), sampled.get(seq_id)
            if seq is None or tokens is None or count < 1:
                continue  # it did not sample this step (the scheduler asks only for those that do)
            accepted = tokens[:-1]
            if seq.draft_token_ids[: len(accepted)] != accepted:
                raise PlanError(f"sequence {seq_id}: outputs {tokens} are not a verification of its drafts")
            context = seq.token_ids + accepted + tokens[-1:]  # the last one's K/V is not written yet
            end = len(context) + count - 1  # positions written: up to the last proposal's input
            table = list(seq.block_table)
            while len(table) * bs < end:
                if scratch >= self.num_blocks + SCRATCH_BLOCKS:
                    break
                table.append(scratch)
                scratch += 1
            if len(table) * bs < end:
                break  # scratch used up: the rest of this step's sequences propose nothing
            rows.append(
                SequenceState(
                    seq_id=seq_id,
                    token_ids=context,
                    prompt_len=seq.prompt_len,
                    block_table=table,
                    sampling=seq.sampling,
                    seed=seq.seed,
                    num_computed_tokens=len(context) - 1,
                    num_scheduled_tokens=1,
                )
            )
            counts.append(count)
        proposals: list[list[int]] = [[] for _ in rows]
        cache = self._cache()
        for _ in range(max(counts, default=0)):
            live = [i for i, row in enumerate(rows) if len(proposals[i]) < counts[i]]
            batch = self._batch([rows[i] for i in live])
            logits = self.model.forward(batch, cache, backend)
            assert logits is not None  # the draft model is never sharded
            for i, token in zip(live, logits.argmax(dim=-1).tolist(), strict=True):
                proposals[i].append(token)
                row = rows[i]
                row.token_ids = row.token_ids + [token]
                row.num_computed_tokens += 1
        return [(row.seq_id, tokens) for row, tokens in zip(rows, proposals, strict=True)]

    def _batch(self, seqs: list[SequenceState]) -> InputBatch:
        cfg = self.config
        return build_input_batch(
            seqs, self.spec.block_size, self.device, cfg.head_dim**-0.5, self.dtype, cfg.num_kv_heads
        )

    def _cache(self) -> PagedKVCache:
        if self.cache is None:
            raise RuntimeError("the draft model's cache is allocated once the pool's size is known")
        return self.cache


def log_loaded(draft: DraftModel) -> None:
    log.info(
        "draft model ready",
        draft_model=draft.model_id,
        layers=draft.config.num_layers,
        hidden_size=draft.config.hidden_size,
        kv_bytes_per_block=draft.geometry.bytes_per_block,
        seconds=round(draft.load_seconds, 2),
    )
