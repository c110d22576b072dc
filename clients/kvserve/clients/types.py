"""Plain result types returned by the clients, free of protobuf so callers need not know the wire format."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Usage:
    """Token counts and timings of one finished completion, as measured by the server."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_time_s: float
    ttft_s: float
    e2e_s: float
    speculative: SpeculativeUsage | None = None
    """Set when the server runs speculative decoding: the request's draft tokens (over its n completions)."""


@dataclass(slots=True)
class SpeculativeUsage:
    proposed_tokens: int
    accepted_tokens: int
    verify_steps: int


@dataclass(slots=True)
class TokenLogprobs:
    """The sampled token's logprob, plus the top alternatives when `logprobs=k > 0` was asked for."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class ToolCall:
    """A call the model made: `arguments` is a JSON object as text (json.loads it)."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class Chunk:
    """One streamed piece of completion `index`. The last chunk of an index carries `finish_reason` and `usage`."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "eos" | "length" | "tool_calls" | "abort" | "error"
    usage: Usage | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    """Calls completed in this chunk (their markup is not in `text`)."""


@dataclass(slots=True)
class Completion:
    """A whole completion. For n > 1, `choices` holds every index and the top-level fields mirror index 0."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    index: int = 0
    choices: list[Completion] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
