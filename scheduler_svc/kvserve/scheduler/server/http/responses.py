"""OpenAI's response objects, built from the engine's chunks: completions, chunks, usage, logprobs.

The shapes follow the `openai` SDK's types exactly (`ChatCompletion`, `ChatCompletionChunk`,
`Completion`; a test parses every response with them). Plain dicts, encoded once per
SSE event: at hundreds of streams the per-event cost matters more than the convenience
of models.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from kvserve.protos.stop_rules import FinishReason
from kvserve.scheduler.core import SampledLogprob
from kvserve.scheduler.server.delivery.request_stream import Usage
from kvserve.scheduler.server.intake.tokenizer import Tokenizer
from kvserve.scheduler.server.tools.tool_use import ENDS_AFTER_CALLS, ToolCall

FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.EOS: "stop",
    FinishReason.GRAMMAR: "stop",
    FinishReason.LENGTH: "length",
}
"""eos, a stop token and a stop string are all OpenAI's "stop"; ABORT and ERROR end with an error instead."""
SSE_DONE = b"data: [DONE]\n\n"
MIN_LOGPROB = -9999.0
"""Stands in for -inf (a masked token) in logprobs: JSON has no infinities (vLLM does the same)."""


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""No caching, and no buffering by a proxy in front (nginx), so each event leaves at once."""


def sse(event: dict[str, Any]) -> bytes:
    """One server-sent event: `data: {json}` and a blank line."""
    return b"data: " + json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


@dataclass(slots=True)
class Envelope:
    """What every object of one response repeats."""

    id: str
    created: int
    model: str


@dataclass(slots=True)
class ChoiceState:
    """One choice as far as it has been received: text, logprobs, and its end."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[SampledLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    text_offset: int = 0
    """Characters already streamed (completions logprobs' `text_offset`)."""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def finish(self, reason: FinishReason, usage: Usage | None) -> str:
        """Record the end; OpenAI's name for it (`tool_calls` once the choice has made calls)."""
        self.finish_reason = "tool_calls" if self.tool_calls and reason in ENDS_AFTER_CALLS else FINISH_REASONS[reason]
        self.usage = usage
        return self.finish_reason


def tool_call_object(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_deltas(call: ToolCall, index: int) -> list[dict[str, Any]]:
    """A streamed call as OpenAI sends one: id, type and name first, then the arguments."""
    return [
        {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}},
        {"index": index, "function": {"arguments": call.arguments}},
    ]


def _message(choice: ChoiceState) -> dict[str, Any]:
    content: str | None = "".join(choice.text)
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if choice.tool_calls:
        if not content:
            message["content"] = None  # only calls were made
        message["tool_calls"] = [tool_call_object(c) for c in choice.tool_calls]
    return message


def usage_object(choices: list[ChoiceState], n: int) -> dict[str, Any]:
    """Totals over choices; the prompt of each of the request's prompts counts once, whatever n is."""
    prompt_tokens = cached = completion_tokens = host_cached = disk_cached = 0
    speculative: dict[str, int] | None = None
    for choice in choices:
        if choice.usage is None:
            continue
        completion_tokens += choice.usage.completion_tokens
        if choice.index % n == 0:  # the first choice of its prompt
            prompt_tokens += choice.usage.prompt_tokens
            cached += choice.usage.cached_tokens
            host_cached += choice.usage.host_cached_tokens
            disk_cached += choice.usage.disk_cached_tokens
            drafts = choice.usage.drafts  # one request's counts, shared by its n choices
            if drafts is not None:
                speculative = speculative or dict.fromkeys(("proposed_tokens", "accepted_tokens", "verify_steps"), 0)
                speculative["proposed_tokens"] += drafts.proposed
                speculative["accepted_tokens"] += drafts.accepted
                speculative["verify_steps"] += drafts.verify_steps
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if host_cached or disk_cached:  # kvserve extension fields: how much of cached_tokens came from below the pool
        usage["prompt_tokens_details"].update(host_cached_tokens=host_cached, disk_cached_tokens=disk_cached)
    if speculative is not None:
        usage["speculative"] = speculative  # a kvserve extension field
    return usage


def json_logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


class LogprobFormatter:
    """Token ids → the strings OpenAI's logprobs name them by (special tokens shown, not hidden)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 65_536:
                self._cache[token_id] = text
        return text

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token(token_id)
        return {"token": text, "logprob": json_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    def chat(self, entries: list[SampledLogprob]) -> dict[str, Any]:
        """`ChoiceLogprobs`: one `ChatCompletionTokenLogprob` per generated token."""
        content = []
        for lp in entries:
            entry = self._entry(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [self._entry(t.token_id, t.logprob) for t in lp.top]
            content.append(entry)
        return {"content": content, "refusal": None}

    def completion(self, entries: list[SampledLogprob], offset: int) -> dict[str, Any]:
        """The legacy completions shape: parallel lists, `top_logprobs` as {token: logprob} per position."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for lp in entries:
            text = self.token(lp.token_id)
            tokens.append(text)
            token_logprobs.append(json_logprob(lp.logprob))
            top.append(
                {text: json_logprob(lp.logprob), **{self.token(t.token_id): json_logprob(t.logprob) for t in lp.top}}
            )
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_completion(env: Envelope, choices: list[ChoiceState], n: int, formatter: LogprobFormatter | None) -> dict:
    return {
        "id": env.id,
        "object": "chat.completion",
        "created": env.created,
        "model": env.model,
        "choices": [
            {
                "index": c.index,
                "message": _message(c),
                "logprobs": formatter.chat(c.logprobs) if formatter is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage_object(choices, n),
    }


def completion(env: Envelope, choices: list[ChoiceState], n: int, formatter: LogprobFormatter | None) -> dict:
    return {
        "id": env.id,
        "object": "text_completion",
        "created": env.created,
        "model": env.model,
        "choices": [
            {
                "index": c.index,
                "text": "".join(c.text),
                "logprobs": formatter.completion(c.logprobs, 0) if formatter is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage_object(choices, n),
    }


def _chunk(env: Envelope, obj: str, choice: dict[str, Any] | None, with_usage: bool) -> dict[str, Any]:
    """One streamed event; with include_usage every chunk says `usage: null` until the last."""
    event: dict[str, Any] = {
        "id": env.id,
        "object": obj,
        "created": env.created,
        "model": env.model,
        "choices": [choice] if choice is not None else [],
    }
    if with_usage:
        event["usage"] = None
    return event


def chat_chunk(env: Envelope, choice: dict[str, Any] | None, *, with_usage: bool) -> dict[str, Any]:
    """A `ChatCompletionChunk`."""
    return _chunk(env, "chat.completion.chunk", choice, with_usage)


def completion_chunk(env: Envelope, choice: dict[str, Any] | None, *, with_usage: bool) -> dict[str, Any]:
    """A streamed `Completion`: the same object as the final one, with a delta's text."""
    return _chunk(env, "text_completion", choice, with_usage)
