"""Structured output on the executor: unpack a plan's token bitmasks and apply them to the logits.

The scheduler's grammar matchers fill one bitmask row per constrained sequence that
samples this step (`StepPlan.mask_seq_ids` / `token_masks`). Here they become a bool
`allowed` matrix on the logits' device (the packed words travel, 32 tokens per int32,
and are unpacked there) and masked-out tokens get -inf before any sampling step, so
greedy, seeded draws, top-k/p and logprobs all see the constrained distribution.
Unconstrained sequences are absent from the plan's lists and cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.protos.step import PlanError, StepPlan

_BYTE_BITS = 1 << torch.arange(8, dtype=torch.uint8)
"""Token t is bit t % 8 of byte t // 8 of a row: the little-endian uint32 layout, read bytewise."""


@dataclass(slots=True)
class TokenMasks:
    """Rows of the sampling batch that are constrained, and what each may not sample."""

    rows: torch.Tensor
    """[k] int64 indices into the sampled logits."""
    blocked: torch.Tensor
    """[k, vocab] bool: True where the grammar forbids the token."""
    all_rows: bool = False
    """Every row of the batch is constrained, in order: the logits are masked without a gather."""


def unpack_blocked(packed: bytes, num_rows: int, vocab: int, device: torch.device | str) -> torch.Tensor:
    """[num_rows, vocab] bool, True where a token is *not* allowed; tokens past a row's bits are blocked.

    Bytewise on the logits' device: the packed rows travel (a 32nd of the bool matrix) and
    one AND against the 8 bit values unpacks them, the cheapest torch form measured on CPU.
    """
    data = torch.frombuffer(bytearray(packed), dtype=torch.uint8).view(num_rows, -1).to(device)
    blocked = (data.unsqueeze(-1) & _BYTE_BITS.to(device)).view(num_rows, -1) == 0
    width = blocked.shape[1]
    if width >= vocab:
        return blocked[:, :vocab]
    return torch.nn.functional.pad(blocked, (0, vocab - width), value=True)


def plan_token_masks(
    plan: StepPlan, sampling_seq_ids: Sequence[int], vocab: int, device: torch.device | str
) -> TokenMasks | None:
    """The plan's masks, matched to the rows of the sampled logits (None: nothing is constrained).

    A sequence verifying draft tokens samples at several rows, in position order, and has as
    many mask rows in the same order: the i-th mask of a sequence goes to its i-th row.
    """
    if not plan.mask_seq_ids:
        return None
    positions: dict[int, list[int]] = {}
    for row, seq_id in enumerate(sampling_seq_ids):
        positions.setdefault(seq_id, []).append(row)
    taken: dict[int, int] = {}
    rows = []
    for seq_id in plan.mask_seq_ids:
        seq_rows = positions.get(seq_id)
        if seq_rows is None:
            raise PlanError(f"step {plan.step_id}: seq {seq_id} has a token mask but samples nothing this step")
        index = taken.get(seq_id, 0)
        if index >= len(seq_rows):
            raise PlanError(f"step {plan.step_id}: seq {seq_id} has more token masks than sampled positions")
        taken[seq_id] = index + 1
        rows.append(seq_rows[index])
    for seq_id, count in taken.items():
        if count != len(positions[seq_id]):
            raise PlanError(
                f"step {plan.step_id}: seq {seq_id} samples at {len(positions[seq_id])} positions "
                f"but has {count} token masks"
            )
    blocked = unpack_blocked(plan.token_masks, len(rows), vocab, device)
    all_rows = rows == list(range(len(sampling_seq_ids)))
    return TokenMasks(torch.tensor(rows, dtype=torch.long, device=device), blocked, all_rows)


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks, *, may_empty: bool = True) -> None:
    """Set every blocked token of the constrained rows to -inf, in place.

    `may_empty`: a row may have lost every allowed token already (min_tokens held back the
    end-of-sequence token that is all the grammar still allows); such a row gets 0 on its
    allowed tokens instead, since the grammar wins: no other token could ever be valid.
    The sampler passes False when it held nothing back, which skips the check.
    """
    if masks.all_rows:
        logits.masked_fill_(masks.blocked, float("-inf"))
    else:
        sub = logits.index_select(0, masks.rows).masked_fill_(masks.blocked, float("-inf"))
        logits.index_copy_(0, masks.rows, sub)
    if may_empty:
        _revive_empty_rows(logits, masks.blocked, masks.rows)


def _revive_empty_rows(logits: torch.Tensor, blocked: torch.Tensor, rows: torch.Tensor) -> None:
    empty = torch.isneginf(logits.index_select(0, rows).amax(dim=-1))
    if bool(empty.any()):
        fallback = torch.zeros_like(blocked[empty], dtype=logits.dtype).masked_fill_(blocked[empty], float("-inf"))
        logits.index_copy_(0, rows[empty], fallback)
