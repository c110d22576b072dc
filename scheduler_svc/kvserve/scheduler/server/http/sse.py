"""Server-sent event streams of chat and completions chunks, ending `data: [DONE]`.

Every choice opens at once (chat: a delta with `role: assistant`; completions with
`echo`: the prompt), then one event per engine chunk that carries text, logprobs or the
finish, and two per tool call (its id, type and name; then its arguments), as OpenAI
streams them. With `stream_options.include_usage` a last event with no choices holds the usage.
A failure mid-stream (executor lost for good, drain) becomes one `{"error": ...}` event:
the 200 status is already sent. Leaving the generator, by failure, normal end or a
client disconnect (Starlette cancels it), aborts whatever is still running.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvserve.scheduler.server.delivery.request_stream import CompletionChunk, RequestFailed
from kvserve.scheduler.server.http.errors import from_failure
from kvserve.scheduler.server.http.generation import Submission
from kvserve.scheduler.server.http.responses import (
    SSE_DONE,
    ChoiceState,
    Envelope,
    LogprobFormatter,
    chat_chunk,
    completion_chunk,
    sse,
    tool_call_deltas,
    usage_object,
)


@dataclass(slots=True)
class StreamShape:
    """What one response's events repeat or depend on."""

    env: Envelope
    n: int
    include_usage: bool
    formatter: LogprobFormatter | None
    prefixes: list[str] | None = None
    """Completions with `echo`: each prompt's text, sent as its choices' first event."""


async def chat_events(submission: Submission, shape: StreamShape) -> AsyncIterator[bytes]:
    def opening(choice: ChoiceState) -> dict[str, Any]:
        return {
            "index": choice.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def events(choice: ChoiceState, chunk: CompletionChunk, finish: str | None) -> list[dict[str, Any]]:
        out = []
        if chunk.text or chunk.logprobs or not chunk.tool_calls:
            logprobs = shape.formatter.chat(chunk.logprobs) if shape.formatter and chunk.logprobs else None
            delta = {"content": chunk.text} if chunk.text else {}
            out.append({"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": None})
        first = len(choice.tool_calls) - len(chunk.tool_calls)
        for k, call in enumerate(chunk.tool_calls, start=first):
            for part in tool_call_deltas(call, k):
                out.append(
                    {"index": choice.index, "delta": {"tool_calls": [part]}, "logprobs": None, "finish_reason": None}
                )
        out[-1]["finish_reason"] = finish
        return out

    async for data in _events(submission, shape, chat_chunk, opening, events):
        yield data


async def completion_events(submission: Submission, shape: StreamShape) -> AsyncIterator[bytes]:
    def opening(choice: ChoiceState) -> dict[str, Any] | None:
        if shape.prefixes is None:
            return None
        text = shape.prefixes[choice.index // shape.n]
        choice.text_offset = len(text)
        return {"index": choice.index, "text": text, "logprobs": None, "finish_reason": None}

    def events(choice: ChoiceState, chunk: CompletionChunk, finish: str | None) -> list[dict[str, Any]]:
        logprobs = None
        if shape.formatter is not None and chunk.logprobs:
            logprobs = shape.formatter.completion(chunk.logprobs, choice.text_offset)
        choice.text_offset += len(chunk.text)
        return [{"index": choice.index, "text": chunk.text, "logprobs": logprobs, "finish_reason": finish}]

    async for data in _events(submission, shape, completion_chunk, opening, events):
        yield data


async def _events(
    submission: Submission,
    shape: StreamShape,
    wrap: Callable[..., dict[str, Any]],
    opening: Callable[[ChoiceState], dict[str, Any] | None],
    events: Callable[[ChoiceState, CompletionChunk, str | None], list[dict[str, Any]]],
) -> AsyncIterator[bytes]:
    """The shared stream: openings, events per meaningful chunk, usage, [DONE]; abort on the way out."""
    choices = [ChoiceState(index=k) for k in range(len(submission.streams) * shape.n)]
    try:
        for choice in choices:
            first = opening(choice)
            if first is not None:
                yield sse(wrap(shape.env, first, with_usage=shape.include_usage))
        async for prompt, chunk in submission.chunks():
            choice = choices[prompt * shape.n + chunk.index]
            choice.tool_calls.extend(chunk.tool_calls)
            finish = choice.finish(chunk.finish_reason, chunk.usage) if chunk.finish_reason is not None else None
            if finish is None and not chunk.text and not chunk.logprobs and not chunk.tool_calls:
                continue  # text held back (a possible stop string, a tool call's tag): nothing to say yet
            for item in events(choice, chunk, finish):
                yield sse(wrap(shape.env, item, with_usage=shape.include_usage))
        if shape.include_usage:
            last = wrap(shape.env, None, with_usage=False)
            last["usage"] = usage_object(choices, shape.n)
            yield sse(last)
        yield SSE_DONE
    except RequestFailed as exc:
        yield sse(from_failure(exc).body())
        yield SSE_DONE
    finally:
        submission.abort_unfinished()
