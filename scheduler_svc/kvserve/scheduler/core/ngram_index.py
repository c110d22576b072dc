"""Prompt lookup (`--speculative ngram`): propose the tokens that followed the last n tokens before.

Each sequence keeps a dict from every n-gram of its own tokens (n in [ngram_min, ngram_max]) to
where its latest earlier occurrence ended, filled incrementally as tokens arrive: a step costs
O(new tokens × n range) dict updates and one lookup per n, never a scan of the context. That
keeps the proposer off the profile of a 2,000-token decode, where a scan per step would cost
milliseconds of Python. The latest occurrence wins, which is what copying text wants: an
edited paragraph is followed by its next sentence, not by one from further back.
"""

from __future__ import annotations


class NgramIndex:
    """The n-grams of one sequence's tokens, to propose continuations of its current suffix."""

    __slots__ = ("_ends", "_indexed", "max_n", "min_n")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._ends: dict[tuple[int, ...], int] = {}
        """n-gram → the position right after its latest occurrence that is not the current suffix."""
        self._indexed = 0
        """n-grams ending before this position are in `_ends`."""

    def propose(self, tokens: list[int], limit: int) -> tuple[int, list[int]]:
        """(n, up to `limit` tokens) that followed the longest earlier match of the suffix; (0, []) if none."""
        if limit <= 0:
            return 0, []
        length = len(tokens)
        self._index_until(tokens, length - 1)  # every occurrence that has a continuation
        ends = self._ends
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = ends.get(tuple(tokens[length - n :]))
            if start is not None:
                return n, tokens[start : start + limit]
        return 0, []

    def _index_until(self, tokens: list[int], stop: int) -> None:
        """Record every n-gram that ends at a position in [self._indexed, stop)."""
        ends = self._ends
        min_n, max_n = self.min_n, self.max_n
        for end in range(self._indexed, stop):
            after = end + 1
            for n in range(min_n, min(max_n, after) + 1):
                ends[tuple(tokens[after - n : after])] = after
        self._indexed = max(self._indexed, stop)
