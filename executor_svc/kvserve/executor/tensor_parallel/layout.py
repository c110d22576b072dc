"""Which part of the model one rank holds, vLLM-style.

- **Column-parallel** q/k/v and gate/up: a rank holds the output rows of its attention heads and
  of its slice of the MLP, so attention and the SwiGLU run on local data with no communication.
- **Row-parallel** o_proj and down: a rank holds the matching input columns; its product is a
  partial sum, and one all-reduce per matrix completes it.
- **Vocab-parallel** embedding and lm_head: a rank holds a contiguous range of vocabulary rows.
  A lookup outside it yields zeros (the all-reduce fills them in); lm_head logits are gathered
  on rank 0, where the sampler runs. The ranges are padded to equal sizes for the gather.
- **KV heads** are split like query heads while there are at least N of them; with fewer, each is
  replicated on N / kv_heads ranks, next to the query heads that read it.

A model whose head counts do not fit N is refused before anything loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvserve.executor.model_config import ModelConfig

MAX_SIZE_LISTED = 16
"""Sizes that fit are listed up to this one in a refusal."""


class TensorParallelFitError(ValueError):
    """The model's head counts (or MLP width) cannot be split across the asked number of ranks."""


@dataclass(frozen=True, slots=True)
class TensorParallelLayout:
    rank: int
    size: int
    num_heads: int
    """Query heads on this rank."""
    num_kv_heads: int
    """KV heads on this rank (a replicated head counts once)."""
    head_dim: int
    first_head: int
    first_kv_head: int
    intermediate: int
    """MLP width on this rank."""
    vocab_size: int
    vocab_shard: int
    """Vocabulary rows per rank, padded: size × vocab_shard ≥ vocab_size."""

    @property
    def q_rows(self) -> slice:
        """This rank's rows of q_proj (and columns of o_proj)."""
        return _span(self.first_head * self.head_dim, self.num_heads * self.head_dim)

    @property
    def kv_rows(self) -> slice:
        """This rank's rows of k_proj and v_proj."""
        return _span(self.first_kv_head * self.head_dim, self.num_kv_heads * self.head_dim)

    @property
    def mlp_rows(self) -> slice:
        """This rank's rows of gate_proj and up_proj (and columns of down_proj)."""
        return _span(self.rank * self.intermediate, self.intermediate)

    @property
    def vocab_rows(self) -> slice:
        """This rank's vocabulary rows that exist (the last range may be short of `vocab_shard`)."""
        start = min(self.rank * self.vocab_shard, self.vocab_size)
        return slice(start, min(start + self.vocab_shard, self.vocab_size))

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def shard_config(self, config: ModelConfig) -> ModelConfig:
        """`config` as this rank's forward pass sees it: its own heads and MLP width."""
        return dataclasses.replace(
            config, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, intermediate_size=self.intermediate
        )


def plan_layout(config: ModelConfig, rank: int, size: int) -> TensorParallelLayout:
    """Rank `rank`'s share of `config` split `size` ways; `TensorParallelFitError` when it does not fit."""
    check_fits(config, size)
    heads, kv = config.num_heads // size, max(1, config.num_kv_heads // size)
    first_head = rank * heads
    # With fewer KV heads than ranks, the KV head of this rank's query heads (a GQA group never straddles it).
    first_kv = rank * kv if config.num_kv_heads >= size else first_head * config.num_kv_heads // config.num_heads
    return TensorParallelLayout(
        rank=rank,
        size=size,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=config.head_dim,
        first_head=first_head,
        first_kv_head=first_kv,
        intermediate=config.intermediate_size // size,
        vocab_size=config.vocab_size,
        vocab_shard=-(-config.vocab_size // size),
    )


def check_fits(config: ModelConfig, size: int, group_columns: int = 1) -> None:
    """`group_columns`: a row-parallel shard's input width must be a multiple of it (32 for Q4_1 weights,
    whose 32-weight groups cannot be split)."""
    problems = _misfits(config, size, group_columns)
    if problems:
        fitting = [n for n in range(1, MAX_SIZE_LISTED + 1) if not _misfits(config, n, group_columns)]
        raise TensorParallelFitError(
            f"--tensor-parallel-size {size} does not fit this model: {'; '.join(problems)} "
            f"(sizes that fit: {', '.join(map(str, fitting))})"
        )


def _misfits(config: ModelConfig, size: int, group_columns: int = 1) -> list[str]:
    heads, kv = config.num_heads, config.num_kv_heads
    problems = []
    if heads % size:
        problems.append(f"num_attention_heads {heads} is not divisible by {size}")
    if kv >= size and kv % size:
        problems.append(f"num_key_value_heads {kv} is not divisible by {size}")
    if kv < size and size % kv:
        problems.append(f"{size} is not a multiple of num_key_value_heads {kv} (each KV head would be replicated)")
    if config.intermediate_size % size:
        problems.append(f"intermediate_size {config.intermediate_size} is not divisible by {size}")
    if (size - 1) * -(-config.vocab_size // size) >= config.vocab_size:
        problems.append(f"vocab_size {config.vocab_size} leaves the last of {size} ranks no vocabulary rows")
    if problems or group_columns == 1 or size == 1:  # one rank splits no group
        return problems
    widths = {"attention": heads // size * config.head_dim, "MLP": config.intermediate_size // size}
    for name, width in widths.items():
        if width % group_columns:
            problems.append(f"each rank's {name} columns ({width}) are not a multiple of {group_columns}")
    return problems


def _span(start: int, length: int) -> slice:
    return slice(start, start + length)
