"""Repetition, presence and frequency penalties, applied to a batch of logit rows.

Definitions (as in vLLM / the OpenAI API):
- repetition (multiplicative, over prompt and output tokens): a seen token's logit is
  divided by the penalty when positive and multiplied by it when negative;
- presence (additive, over output tokens): subtract the penalty once from every token
  that appeared in the output;
- frequency (additive, over output tokens): subtract penalty × occurrence count.
"""

from __future__ import annotations

import torch


def apply_penalties(
    logits: torch.Tensor,
    prompt_tokens: list[list[int]],
    output_tokens: list[list[int]],
    repetition: list[float],
    presence: list[float],
    frequency: list[float],
) -> torch.Tensor:
    """Penalise `logits` [n, vocab] in place, row i using its own token lists; returns `logits`."""
    n, vocab = logits.shape
    device = logits.device
    counts = _token_counts(output_tokens, n, vocab, device)
    seen_output = counts > 0
    rep = torch.tensor(repetition, dtype=logits.dtype, device=device)[:, None]
    if (rep != 1.0).any():
        seen = seen_output | (_token_counts(prompt_tokens, n, vocab, device) > 0)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalised, logits))
    freq = torch.tensor(frequency, dtype=logits.dtype, device=device)[:, None]
    pres = torch.tensor(presence, dtype=logits.dtype, device=device)[:, None]
    logits -= freq * counts.to(logits.dtype) + pres * seen_output.to(logits.dtype)
    return logits


def _token_counts(token_lists: list[list[int]], n: int, vocab: int, device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(n, vocab + 1, dtype=torch.int32, device=device)
    if width == 0:
        return counts[:, :vocab]
    padded = torch.full((n, width), vocab, dtype=torch.long)  # pads land in the extra column
    for i, tokens in enumerate(token_lists):
        padded[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    counts.scatter_add_(1, padded.to(device), torch.ones(n, width, dtype=torch.int32, device=device))
    return counts[:, :vocab]
