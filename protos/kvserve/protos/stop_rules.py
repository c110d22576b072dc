"""When a sequence ends: the token-level stop rules, in one place for both processes.

The scheduler applies them to each sampled token (`stop_reason`); the executor's
sampler and the fake executor use `stop_tokens_allowed` and `stop_token_ids` to never
draw a stop token before `min_tokens` outputs exist. One definition keeps the three
from disagreeing at the `min_tokens` boundary. Stop *strings* are text, not tokens:
the scheduler service's detokenizer matches them and ends the sequence at the next
step boundary, the way an abort does.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from kvserve.protos.sampling import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a sequence ended; the value is what the APIs report."""

    STOP = "stop"
    """A stop token id or a stop string."""
    EOS = "eos"
    GRAMMAR = "grammar"
    """Structured output is complete (its grammar admits no further token); the APIs report it as stop.
    Unlike STOP and EOS, the token that ended it is part of the text."""
    LENGTH = "length"
    """max_tokens reached, or the sequence reached max_model_len."""
    ABORT = "abort"
    ERROR = "error"
    """It could not be completed around an executor change or failure (e.g. it no longer fits a new executor)."""
    INTERNAL = "internal"
    """The executor broke its contract for this sequence (it sampled a token the grammar forbids): a bug,
    never the client's doing; the APIs fail the request with an internal error (HTTP 500, gRPC INTERNAL)."""


def stop_token_ids(sampling: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """Every token id that ends this sequence: its stop token ids, plus eos unless `ignore_eos`."""
    ids = set(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        ids.update(eos_token_ids)
    return frozenset(ids)


def stop_tokens_allowed(sampling: SamplingParams, num_output_before: int) -> bool:
    """Whether the next token may be a stop token, given the outputs that exist before it.

    Like vLLM: eos and stop token ids cannot be drawn while fewer than `min_tokens`
    outputs exist, so a sequence has at least `min_tokens` outputs before the one that ends it.
    """
    return num_output_before >= sampling.min_tokens


def stop_reason(
    sampling: SamplingParams,
    token_id: int,
    num_output_tokens: int,
    num_tokens: int,
    eos_token_ids: frozenset[int],
    max_model_len: int,
) -> FinishReason | None:
    """The reason the sequence ends with `token_id` (already appended, so counted in both
    `num_output_tokens` and `num_tokens`), or None to go on. Length limits always apply."""
    if stop_tokens_allowed(sampling, num_output_tokens - 1):
        if token_id in eos_token_ids and not sampling.ignore_eos:
            return FinishReason.EOS
        if token_id in sampling.stop_token_ids:
            return FinishReason.STOP
    if num_output_tokens >= sampling.max_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
