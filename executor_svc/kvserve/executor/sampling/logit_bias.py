"""Per-request logit biases (OpenAI's `logit_bias`), added to a batch of logit rows.

A row's `SamplingParams.logit_bias` pairs (token id, bias) are added to that row's logits; a
bias of -MAX_ABS_LOGIT_BIAS (-100, the lowest the API accepts) is a ban, as OpenAI documents
it: the token's logit becomes -inf, so neither argmax nor a seeded draw can pick it. The
sampler applies biases after the penalties and before structured output's token masks, so a
bias never re-admits a token the grammar forbids; where a ban leaves a row no token the
grammar allows, the grammar wins (`token_mask.apply_token_masks(may_empty=True)`).

Only rows with a bias pay anything: their entries are gathered, added and written back in one
indexed operation over the whole batch. Each entry reads and writes its own row's element
only, so a row's biased logits are the same bits whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.config import defaults

BAN = -defaults.MAX_ABS_LOGIT_BIAS
"""A bias at or below this bans the token (-inf) instead of being added."""


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[tuple[tuple[int, float], ...]]) -> bool:
    """Add row i's `biases[i]` pairs to `logits` [n, vocab] in place (a ban sets -inf); True if any
    token was banned. Ids outside the row are skipped (the API checked them against the vocabulary)."""
    vocab = logits.shape[1]
    rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    banned = False
    for i, bias in enumerate(biases):
        for token, value in bias:
            if 0 <= token < vocab:
                rows.append(i)
                tokens.append(token)
                values.append(float("-inf") if value <= BAN else value)
                banned |= value <= BAN
    if not rows:
        return False
    device = logits.device
    index = (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(tokens, dtype=torch.long, device=device))
    added = torch.tensor(values, dtype=logits.dtype, device=device)
    logits.index_put_(index, logits[index] + added)
    return banned
