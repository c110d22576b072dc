"""Lookup over recent completions (`--speculative suffix`), one index per prefix namespace.

Requests that ask alike answer alike: a support bot's replies, a JSON shape every call
fills, code regenerated after a small edit. `SuffixIndex` keeps the most recent finished
completions' tokens (each with the tail of its prompt, so the start of an answer is found
from the end of a question) and maps every n-gram in them to where its latest occurrence
ended, like `NgramIndex` does within one sequence.

Entries live under their request's prefix namespace, the key that already keeps tenants'
KV apart, and a lookup reads only its own namespace's dict: no proposal can carry another
tenant's tokens. The whole index holds at most `capacity` tokens; the oldest completion
goes first, and its n-grams leave the dict unless a newer entry has taken them over.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Namespace:
    ends: dict[tuple[int, ...], tuple[int, int]] = field(default_factory=dict)
    """n-gram → (entry id, position right after its latest occurrence in that entry)."""


class SuffixIndex:
    """Recent completions' n-grams by namespace, bounded by `capacity` tokens in all."""

    __slots__ = ("_entries", "_namespaces", "_next_id", "_tokens", "capacity", "max_n", "min_n")

    def __init__(self, min_n: int, max_n: int, capacity: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.capacity = capacity
        self._namespaces: dict[str, _Namespace] = {}
        self._entries: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()
        """Entry id → (namespace, tokens), oldest first."""
        self._next_id = 0
        self._tokens = 0

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def add(self, namespace: str, tokens: list[int], prompt_len: int) -> None:
        """Remember a finished completion: its output after the last `max_n` tokens of its prompt."""
        if len(tokens) <= prompt_len:
            return
        tokens = tokens[max(0, prompt_len - self.max_n) :]
        if len(tokens) > self.capacity:
            tokens = tokens[-self.capacity :]
        while self._entries and self._tokens + len(tokens) > self.capacity:
            self._evict_oldest()
        entry = self._next_id
        self._next_id += 1
        self._entries[entry] = (namespace, tokens)
        self._tokens += len(tokens)
        ends = self._namespaces.setdefault(namespace, _Namespace()).ends
        min_n, max_n = self.min_n, self.max_n
        for after in range(min_n, len(tokens)):  # occurrences with a continuation
            for n in range(min_n, min(max_n, after) + 1):
                ends[tuple(tokens[after - n : after])] = (entry, after)

    def propose(self, namespace: str, tokens: list[int], limit: int) -> tuple[int, list[int]]:
        """(n, up to `limit` tokens) that followed the longest match of `tokens`' suffix; (0, []) if none."""
        space = self._namespaces.get(namespace)
        if space is None or limit <= 0:
            return 0, []
        ends, length = space.ends, len(tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            found = ends.get(tuple(tokens[length - n :]))
            if found is not None:
                entry, start = found
                return n, self._entries[entry][1][start : start + limit]
        return 0, []

    def _evict_oldest(self) -> None:
        entry, (namespace, tokens) = self._entries.popitem(last=False)
        self._tokens -= len(tokens)
        space = self._namespaces[namespace]
        ends = space.ends
        min_n, max_n = self.min_n, self.max_n
        for after in range(min_n, len(tokens)):
            for n in range(min_n, min(max_n, after) + 1):
                key = tuple(tokens[after - n : after])
                found = ends.get(key)
                if found is not None and found[0] == entry:
                    del ends[key]
        if not ends:
            del self._namespaces[namespace]
