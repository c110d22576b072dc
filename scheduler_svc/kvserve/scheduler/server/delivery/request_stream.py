"""The per-request channel from the engine loop to one API call.

The engine loop must never wait on a client, or one slow reader would stall every
stream. So `put` never blocks: the buffer holds at most `max_chunks` chunks, and once
it is full a new chunk is merged into the newest buffered chunk of the same completion
(token ids appended, text concatenated). A slow reader thus receives fewer, larger
chunks; memory stays bounded by the request's own max_tokens. The reader also merges
consecutive buffered chunks of one completion, so a backlog costs one gRPC message, not many.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvserve.protos.stop_rules import FinishReason
from kvserve.scheduler.core import DraftCounts, SampledLogprob
from kvserve.scheduler.server.tools.tool_use import ToolCall


class FailureKind(str, enum.Enum):
    """Why a request ended without a normal finish; the API maps these to gRPC status codes."""

    UNAVAILABLE = "unavailable"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    INTERNAL = "internal"


class RequestFailed(Exception):
    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_time_s: float
    ttft_s: float
    e2e_s: float
    drafts: DraftCounts | None = None
    """The request's speculative-decoding counts (shared by its n completions); None: speculation off."""
    host_cached_tokens: int = 0
    """Of `cached_tokens`, those loaded for this request from host memory (`--kv-host-gb`)."""
    disk_cached_tokens: int = 0
    """Of `cached_tokens`, those loaded for this request from disk (`--kv-disk-dir`)."""


@dataclass(slots=True)
class CompletionChunk:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[SampledLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    """Calls completed in this chunk (their markup is not in `text`)."""

    def absorb(self, later: CompletionChunk) -> None:
        self.token_ids.extend(later.token_ids)
        self.text += later.text
        self.logprobs.extend(later.logprobs)
        self.tool_calls.extend(later.tool_calls)
        self.finish_reason = later.finish_reason
        self.usage = later.usage


class RequestStream:
    """Chunks of one request, in order; ends normally, or with `RequestFailed`."""

    def __init__(self, request_id: str, max_chunks: int) -> None:
        self.request_id = request_id
        self._max_chunks = max(1, max_chunks)
        self._chunks: deque[CompletionChunk] = deque()
        self._ready = asyncio.Event()
        self._closed = False
        self._error: RequestFailed | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, chunk: CompletionChunk) -> None:
        if self._closed:
            return
        if len(self._chunks) >= self._max_chunks:
            for queued in reversed(self._chunks):
                if queued.index == chunk.index and queued.finish_reason is None:
                    queued.absorb(chunk)
                    self._ready.set()
                    return
        self._chunks.append(chunk)
        self._ready.set()

    def close(self) -> None:
        self._closed = True
        self._ready.set()

    def fail(self, error: RequestFailed) -> None:
        if not self._closed:
            self._error = error
            self.close()

    async def __aiter__(self) -> AsyncIterator[CompletionChunk]:
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                # Whatever piled up while the reader was busy leaves as one message per completion.
                while self._chunks and chunk.finish_reason is None and self._chunks[0].index == chunk.index:
                    chunk.absorb(self._chunks.popleft())
                yield chunk
            if self._closed:
                if self._error is not None:
                    raise self._error
                return
            self._ready.clear()
            if not self._chunks and not self._closed:
                await self._ready.wait()
