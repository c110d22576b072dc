"""Turn the scheduled sequences of a plan into flat tensors for one forward pass.

Tokens of all sequences are packed back to back in scheduling order (no padding).
Only sequences whose scheduled tokens reach the end of their known tokens sample, and
only their last token's hidden state goes through the lm_head; a sequence verifying draft
tokens samples at its last len(drafts) + 1 positions (`sample_counts`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvserve.executor.attention.base import AttentionMetadata
from kvserve.executor.sequence_state import SequenceState
from kvserve.protos.step import PlanError


@dataclass(slots=True)
class InputBatch:
    input_ids: torch.Tensor
    """[num_tokens] int64"""
    positions: torch.Tensor
    """[num_tokens] int64"""
    attention: AttentionMetadata
    sample_indices: torch.Tensor
    """[num_sampling] int64 rows of the packed batch whose logits are sampled."""
    sampling_seqs: list[SequenceState]
    sample_counts: list[int] | None = None
    """Rows of `sample_indices` per sampling sequence, in order; None: one each (no drafts this step)."""
    lora_indices: list[int] | None = None
    """Per token, the index of its sequence's LoRA adapter (`ExecutorInfo.lora_names`), -1 for the base
    model; None when no token of the step has one (`kvserve.executor.lora`)."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def build_input_batch(
    seqs: list[SequenceState],
    block_size: int,
    device: torch.device | str,
    scale: float,
    dtype: torch.dtype = torch.float32,
    num_kv_heads: int = 1,
    lora_indices: Mapping[str, int] | None = None,
) -> InputBatch:
    """`seqs` are the sequences with scheduled tokens, in plan order; `lora_indices`: each loaded LoRA
    adapter's index by name (a sequence's `lora_name` was checked against them when it arrived)."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    query_lens: list[int] = []
    sample_rows: list[int] = []
    sampling_seqs: list[SequenceState] = []
    sample_counts: list[int] = []
    token_adapters: list[int] = []
    under_adapter = False
    for seq in seqs:
        start, count = seq.num_computed_tokens, seq.num_scheduled_tokens
        end = start + count
        tokens = seq.step_tokens()
        if end > len(tokens):
            raise PlanError(
                f"sequence {seq.seq_id}: schedules up to position {end} but only {len(tokens)} tokens are known"
            )
        if len(seq.block_table) * block_size < end:
            raise PlanError(
                f"sequence {seq.seq_id}: block table of {len(seq.block_table)} blocks cannot hold {end} tokens"
            )
        input_ids.extend(tokens[start:end])
        positions.extend(range(start, end))
        adapter = lora_indices[seq.lora_name] if seq.lora_name and lora_indices else -1
        token_adapters.extend([adapter] * count)
        under_adapter = under_adapter or adapter >= 0
        query_start.append(query_start[-1] + count)
        seq_lens.append(end)
        query_lens.append(count)
        if seq.samples_this_step:
            rows = 1 + len(seq.draft_token_ids)
            if rows > count:
                raise PlanError(f"sequence {seq.seq_id}: {rows - 1} drafts but only {count} tokens scheduled")
            sample_rows.extend(range(query_start[-1] - rows, query_start[-1]))
            sampling_seqs.append(seq)
            sample_counts.append(rows)

    width = max(-(-n // block_size) for n in seq_lens)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, seq in enumerate(seqs):
        row = seq.block_table[:width]
        tables[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    pos = torch.tensor(positions, dtype=torch.long)
    seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(query_lens))
    slots = tables[seq_of_token, pos // block_size].long() * block_size + pos % block_size
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        scale=scale,
        block_size=block_size,
        dtype=dtype,
        num_kv_heads=num_kv_heads,
    )
    return InputBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=pos.to(device),
        attention=meta,
        sample_indices=torch.tensor(sample_rows, dtype=torch.long, device=device),
        sampling_seqs=sampling_seqs,
        sample_counts=sample_counts if len(sample_rows) > len(sampling_seqs) else None,
        lora_indices=token_adapters if under_adapter else None,
    )
