"""What a serving workload is made of: sessions of turns, each turn one request.

The generators (`workloads.py`, `copy_workload.py`) build them; the load drivers send them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Turn:
    """One request of a session: the tokens this turn adds and how many to generate."""

    new_token_ids: list[int]
    max_tokens: int


@dataclass(slots=True)
class Session:
    """Turns sent sequentially; `cache_salt` isolates a session's prefix cache when set."""

    session_id: str
    turns: list[Turn]
    cache_salt: str = ""


@dataclass(slots=True)
class Workload:
    """A named list of sessions. `phase` labels cold/warm halves of `cold-warm`."""

    name: str
    sessions: list[Session]
    phase: str = ""
    warmup: list[Session] = field(default_factory=list)
    """Sessions sent (and not measured) before the measured ones: primes the cache."""

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def max_request_len(self) -> int:
        """Largest prompt + max_tokens of any request, assuming each turn resends the conversation."""
        longest = 0
        for session in self.sessions:
            history = 0
            for turn in session.turns:
                prompt = history + len(turn.new_token_ids)
                longest = max(longest, prompt + turn.max_tokens)
                history = prompt + turn.max_tokens
        return longest
