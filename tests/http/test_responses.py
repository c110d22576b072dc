"""The response builders without a server: usage arithmetic, SSE framing, logprobs JSON has no infinities."""

from __future__ import annotations

import json
import math

from kvserve.scheduler.server.delivery.request_stream import Usage
from kvserve.scheduler.server.http.responses import MIN_LOGPROB, SSE_DONE, ChoiceState, json_logprob, sse, usage_object


def usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(prompt, completion, cached, queue_time_s=0.0, ttft_s=0.0, e2e_s=0.0)


def test_usage_counts_each_prompt_once_whatever_n() -> None:
    # Two prompts (10 and 4 tokens), n = 3: choices 0-2 belong to the first, 3-5 to the second.
    choices = [ChoiceState(index=k, usage=usage(10 if k < 3 else 4, k + 1, 8 if k < 3 else 0)) for k in range(6)]
    assert usage_object(choices, n=3) == {
        "prompt_tokens": 14,
        "completion_tokens": 1 + 2 + 3 + 4 + 5 + 6,
        "total_tokens": 14 + 21,
        "prompt_tokens_details": {"cached_tokens": 8},
    }


def test_sse_framing() -> None:
    event = sse({"a": "é"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:]) == {"a": "é"}
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_logprobs_never_serialise_infinity() -> None:
    assert json_logprob(-math.inf) == MIN_LOGPROB and json_logprob(math.nan) == MIN_LOGPROB
    assert json_logprob(-0.5) == -0.5
    json.dumps({"x": json_logprob(-math.inf)}, allow_nan=False)
