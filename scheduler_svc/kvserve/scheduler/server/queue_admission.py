"""The engine's queue limits: how many requests, and how many prompt tokens, may wait to start.

A request is queued from `Engine.submit` until its first output (or its end, if it never starts);
past `--max-queued-requests` or `--max-queued-prompt-tokens` a new one is refused at once with
RESOURCE_EXHAUSTED, so a flood is answered instead of piling up. Apart from `engine.Engine`,
which says when a request enters and leaves the queue, so the limits and their counts read in
one place.
"""

from __future__ import annotations

from kvserve.scheduler.server.delivery.request_stream import FailureKind, RequestFailed


class QueueAdmission:
    """Counts the queued requests and their prompt tokens; refuses a request past either limit."""

    def __init__(self, max_requests: int, max_prompt_tokens: int) -> None:
        self._max_requests = max_requests
        self._max_prompt_tokens = max_prompt_tokens
        self._requests = 0
        self._prompt_tokens = 0

    def check_room(self, num_prompt_tokens: int) -> None:
        """Raise RequestFailed(RESOURCE_EXHAUSTED) if a request of this prompt would pass a limit."""
        if self._requests >= self._max_requests:
            raise RequestFailed(
                FailureKind.RESOURCE_EXHAUSTED, f"queue full: {self._requests} requests are waiting; retry later"
            )
        if self._prompt_tokens + num_prompt_tokens > self._max_prompt_tokens:
            raise RequestFailed(
                FailureKind.RESOURCE_EXHAUSTED,
                f"queue full: {self._prompt_tokens} prompt tokens are waiting; retry later",
            )

    def enter(self, num_prompt_tokens: int) -> None:
        self._requests += 1
        self._prompt_tokens += num_prompt_tokens

    def leave(self, num_prompt_tokens: int) -> None:
        """A queued request started, or ended before it started."""
        self._requests -= 1
        self._prompt_tokens -= num_prompt_tokens
