"""When a sequence stops, decided after each sampled token."""

from __future__ import annotations

from protos.sampling import SamplingParams
from scheduler_svc.core.request import FinishReason


def stop_reason(sampling: SamplingParams, token_id: int, num_output_tokens: int, num_tokens: int,
                eos_token_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
    """The reason the sequence ends with `token_id` (already appended), or None to go on.

    eos (unless ignore_eos) and stop token ids count only once `min_tokens` outputs exist,
    counting the new token. Length limits apply regardless. Stop *strings* are matched on
    text by the API's detokenizer, which calls `Scheduler.finish_sequence`.
    """
    if num_output_tokens >= sampling.min_tokens:
        if token_id in eos_token_ids and not sampling.ignore_eos:
            return FinishReason.EOS
        if token_id in sampling.stop_token_ids:
            return FinishReason.STOP
    if num_output_tokens >= sampling.max_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
