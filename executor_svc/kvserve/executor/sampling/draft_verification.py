"""Verifying draft tokens (speculative decoding) by drawing each position as plain decoding would.

A sequence with drafts d_0..d_{k-1} has k + 1 sampled rows: row j holds the logits after its
known tokens and d_0..d_{j-1}. Each row becomes a *position view*, the sequence as it would be
if those drafts had been accepted, so the ordinary sampler applies at row j exactly what a
decode step at that position would: penalties over the outputs so far, `min_tokens`, and the
seeded draw keyed by (seed, output position). The outputs are the draws up to and including
the first that differs from its draft.

For a proposal that is a point mass (n-gram and suffix lookup), this is rejection sampling
with the exact target distribution: d_j is accepted with probability p(d_j) = min(1, p/q),
and a rejected position yields a draw from p conditioned on not being d_j, which is the
normalised residual max(0, p - q). Because the draw at each position is the one speculation-
off decoding makes there, a seeded request gives the same tokens with speculation on or off.
"""

from __future__ import annotations

from kvserve.executor.sequence_state import SequenceState
from kvserve.protos.step import SampledToken


def position_views(seqs: list[SequenceState], counts: list[int]) -> list[SequenceState]:
    """One row per sampled position: each sequence's `counts[i]` views, drafts accepted up to the row."""
    views: list[SequenceState] = []
    for seq, count in zip(seqs, counts, strict=True):
        views.append(seq)
        drafts = seq.draft_token_ids
        for j in range(1, count):
            views.append(
                SequenceState(
                    seq_id=seq.seq_id,
                    token_ids=seq.token_ids + drafts[:j],
                    prompt_len=seq.prompt_len,
                    block_table=seq.block_table,
                    sampling=seq.sampling,
                    seed=seq.seed,
                )
            )
    return views


def accepted_outputs(seqs: list[SequenceState], counts: list[int], drawn: list[SampledToken]) -> list[SampledToken]:
    """Each sequence's draws up to and including the first that is not its draft (all when none differs)."""
    outputs: list[SampledToken] = []
    row = 0
    for seq, count in zip(seqs, counts, strict=True):
        drafts = seq.draft_token_ids
        for j in range(count):
            token = drawn[row + j]
            outputs.append(token)
            if j == count - 1 or token.token_id != drafts[j]:
                break
        row += count
    return outputs
