"""What the core needs from a structured-output constraint: a per-sequence token matcher.

The scheduler owns every sequence's output tokens, so it also owns the matcher that
follows them: `StepBuilder.schedule` asks each constrained sequence that samples this
step for its bitmask (sent in the plan; the executor applies it to the logits), and
`Scheduler.update` feeds each sampled token back. Preemption, recompute and an executor
restart keep the output tokens, so they keep the matcher state too: nothing is rebuilt.

Speculative decoding builds one bitmask per verified position: the builder feeds a
constrained sequence's drafts to its matcher, taking the mask before each, and rolls them
back at once (`constrained_drafts`); the result applier then advances it by the tokens the
executor actually returned, so the matcher only ever holds verified tokens between steps.

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

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding's drafts, once their masks are built)."""
        ...

    @property
    def is_finished(self) -> bool:
        """The grammar admits no further token: the completion is done (finish reason GRAMMAR, "stop" to clients)."""
        ...


class MatcherFactory(Protocol):
    """A compiled constraint: one fresh matcher per completion (n > 1 gets n)."""

    def new_matcher(self) -> TokenMatcher: ...


def allows(mask: bytes, token_id: int) -> bool:
    """Whether a bitmask row allows a token (bit t % 8 of byte t // 8: the little-endian word layout)."""
    index = token_id >> 3
    return index < len(mask) and bool(mask[index] >> (token_id & 7) & 1)


def constrained_drafts(matcher: TokenMatcher, drafts: list[int]) -> tuple[list[int], list[bytes]]:
    """The drafts a grammar allows, and the mask of every position they are verified at.

    Returns (kept, masks) with len(masks) == len(kept) + 1: masks[j] is the grammar's bitmask
    after kept[:j], so the executor constrains each position exactly as plain decoding would.
    Drafts stop before the first the grammar refuses, and before one that would complete it
    (the token that ends the grammar is then drawn at its own position, under its mask). The
    matcher is left as it was.
    """
    masks: list[bytes] = []
    kept = 0
    for token in drafts:
        mask = matcher.next_token_bitmask()
        masks.append(mask)
        if not allows(mask, token) or not matcher.accept(token):
            break
        if matcher.is_finished:
            matcher.rollback(1)
            break
        kept += 1
    else:
        masks.append(matcher.next_token_bitmask())
    if kept:
        matcher.rollback(kept)
    return drafts[:kept], masks
