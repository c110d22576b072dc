"""Turn the scheduled sequences of a plan into flat tensors for one forward pass.

Tokens of all sequences are packed back to back in scheduling order (no padding).
Only sequences whose scheduled tokens reach the end of their known tokens sample, and
only their last token's hidden state goes through the lm_head.
"""

from __future__ import annotations

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
) -> InputBatch:
    """`seqs` are the sequences with scheduled tokens, in plan order."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    query_lens: list[int] = []
    sample_rows: list[int] = []
    sampling_seqs: list[SequenceState] = []
    for seq in seqs:
        start, count = seq.num_computed_tokens, seq.num_scheduled_tokens
        end = start + count
        if end > len(seq.token_ids):
            raise PlanError(
                f"sequence {seq.seq_id}: schedules up to position {end} but only {len(seq.token_ids)} tokens are known"
            )
        if len(seq.block_table) * block_size < end:
            raise PlanError(
                f"sequence {seq.seq_id}: block table of {len(seq.block_table)} blocks cannot hold {end} tokens"
            )
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        query_start.append(query_start[-1] + count)
        seq_lens.append(end)
        query_lens.append(count)
        if seq.samples_this_step:
            sample_rows.append(query_start[-1] - 1)
            sampling_seqs.append(seq)

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
    )
