"""What the core needs from a structured-output constraint: a per-sequence token matcher.

The scheduler owns every sequence's output tokens, so it also owns the matcher that
follows them: `StepBuilder.schedule` asks each constrained sequence that samples this
step for its bitmask (sent in the plan; the executor applies it to the logits), and
`Scheduler.update` feeds each sampled token back. Preemption, recompute and an executor
restart keep the output tokens, so they keep the matcher state too: nothing is rebuilt.

The core knows only these two protocols; the grammar engine behind them (llguidance,
see `kvserve.scheduler.server.structured`) is chosen and compiled by the service.
"""

from __future__ import annotations

from typing import Protocol


class TokenMatcher(Protocol):
    """One completion's position in its grammar."""

    def next_token_bitmask(self) -> bytes:
        """The tokens allowed next: little-endian uint32 words, bit t % 32 of word t // 32 for token t."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        ...

    @property
    def is_finished(self) -> bool:
        """The grammar admits no further token: the completion is done (finish reason GRAMMAR, "stop" to clients)."""
        ...


class MatcherFactory(Protocol):
    """A compiled constraint: one fresh matcher per completion (n > 1 gets n)."""

    def new_matcher(self) -> TokenMatcher: ...
