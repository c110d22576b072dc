"""A tiny grammar over token ids for the core's structured-output tests: the output is one of a few
token sequences. It implements the core's `MatcherFactory` / `TokenMatcher` protocols, so the
scheduler is tested without a grammar engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ChoiceGrammar:
    choices: list[list[int]]
    vocab_size: int
    matchers: list[ChoiceMatcher] = field(default_factory=list)

    def new_matcher(self) -> ChoiceMatcher:
        matcher = ChoiceMatcher(self)
        self.matchers.append(matcher)
        return matcher


@dataclass
class ChoiceMatcher:
    grammar: ChoiceGrammar
    fed: list[int] = field(default_factory=list)
    masks_at: list[int] = field(default_factory=list)
    """len(fed) at each bitmask request: one per step in which the sequence samples."""

    def allowed(self) -> set[int]:
        n = len(self.fed)
        return {c[n] for c in self.grammar.choices if len(c) > n and c[:n] == self.fed}

    def next_token_bitmask(self) -> bytes:
        self.masks_at.append(len(self.fed))
        words = [0] * ((self.grammar.vocab_size + 31) // 32)
        for token in self.allowed():
            words[token // 32] |= 1 << (token % 32)
        return b"".join(w.to_bytes(4, "little") for w in words)

    def accept(self, token_id: int) -> bool:
        if token_id not in self.allowed():
            return False
        self.fed.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        assert 0 < num_tokens <= len(self.fed)
        del self.fed[-num_tokens:]

    @property
    def is_finished(self) -> bool:
        return not self.allowed()
