"""Seeded request generators for the serving benchmark.

Prompts are lists of token ids drawn from the model's vocabulary, so prompt lengths are
exact (no tokenizer round trip) and every run with the same seed sends the same tokens.
Every request sets `ignore_eos`, so output lengths are exactly `max_tokens` and the
baselines generate the same amount of text.

A workload is a list of *sessions*. A session is one or more turns sent one after the
other; single-shot workloads have one turn per session. In `multi-turn`, each turn's
prompt is the whole conversation so far: the previous prompt, the reply the server
actually returned, then the new user tokens (the load driver assembles it).
"""

from __future__ import annotations

import random

from kvserve.bench.copy_workload import TextEncoder, copy_workload
from kvserve.bench.sessions import Session, Turn, Workload

__all__ = ["WORKLOAD_NAMES", "Session", "TextEncoder", "Turn", "Workload", "build", "token_id_range"]

WORKLOAD_NAMES = ("mixed", "shared-prefix", "multi-turn", "cold-warm", "multi-prefix", "copy")
"""`copy` is real text (`copy_workload.py`), built with the model's tokenizer; the rest are token ids."""

MIXED_PROMPT_LEN = (64, 512)
MIXED_OUTPUT_LEN = (32, 256)
SHARED_PREFIX_LEN = 1500
SHARED_QUESTION_LEN = (50, 300)
SHARED_OUTPUT_LEN = (16, 64)
MULTI_PREFIX_COUNT = 8
MULTI_PREFIX_LEN = 1000
MULTI_PREFIX_QUESTION_LEN = (50, 200)
MULTI_PREFIX_OUTPUT_LEN = (16, 64)
MULTI_TURN_MAX_TURNS = 10
MULTI_TURN_USER_LEN = (16, 128)
MULTI_TURN_OUTPUT_LEN = (16, 64)

_FIRST_ORDINARY_TOKEN = 1000
"""Ids below this are left out: small vocabularies put special and byte tokens first."""


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """[low, high) of the ids prompts are drawn from."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    return (min(_FIRST_ORDINARY_TOKEN, vocab_size // 2), vocab_size)


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    low, high = token_id_range(vocab_size)
    return [rng.randrange(low, high) for _ in range(n)]


def _cap(max_tokens: int, cap: int | None) -> int:
    return min(max_tokens, cap) if cap else max_tokens


def mixed(num_requests: int, vocab_size: int, seed: int, max_tokens_cap: int | None = None) -> Workload:
    """Independent prompts of 64–512 tokens asking for 32–256 output tokens: no reuse."""
    rng = random.Random(f"mixed:{seed}")
    sessions = []
    for i in range(num_requests):
        prompt = _tokens(rng, rng.randint(*MIXED_PROMPT_LEN), vocab_size)
        sessions.append(Session(f"mixed-{i}", [Turn(prompt, _cap(rng.randint(*MIXED_OUTPUT_LEN), max_tokens_cap))]))
    return Workload("mixed", sessions)


def shared_prefix(num_requests: int, vocab_size: int, seed: int, max_tokens_cap: int | None = None) -> Workload:
    """A 1,500-token system prompt shared by every request, then a 50–300-token question."""
    rng = random.Random(f"shared-prefix:{seed}")
    system = _tokens(rng, SHARED_PREFIX_LEN, vocab_size)
    sessions = []
    for i in range(num_requests):
        question = _tokens(rng, rng.randint(*SHARED_QUESTION_LEN), vocab_size)
        max_tokens = _cap(rng.randint(*SHARED_OUTPUT_LEN), max_tokens_cap)
        sessions.append(Session(f"shared-{i}", [Turn(system + question, max_tokens)]))
    return Workload("shared-prefix", sessions)


def multi_prefix(
    num_requests: int,
    vocab_size: int,
    seed: int,
    max_tokens_cap: int | None = None,
    *,
    num_prefixes: int = MULTI_PREFIX_COUNT,
) -> Workload:
    """`num_prefixes` distinct 1,000-token system prompts, each request one of them at random
    and then a 50–200-token question: what a replica router must keep apart to keep hitting."""
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be at least 1, got {num_prefixes}")
    rng = random.Random(f"multi-prefix:{seed}")
    systems = [_tokens(rng, MULTI_PREFIX_LEN, vocab_size) for _ in range(num_prefixes)]
    sessions = []
    for i in range(num_requests):
        system = systems[rng.randrange(num_prefixes)]
        question = _tokens(rng, rng.randint(*MULTI_PREFIX_QUESTION_LEN), vocab_size)
        max_tokens = _cap(rng.randint(*MULTI_PREFIX_OUTPUT_LEN), max_tokens_cap)
        sessions.append(Session(f"prefix-{i}", [Turn(system + question, max_tokens)]))
    return Workload("multi-prefix", sessions)


def multi_turn(num_requests: int, vocab_size: int, seed: int, max_tokens_cap: int | None = None) -> Workload:
    """Chats of 1–10 turns until `num_requests` turns exist; each turn resends the conversation."""
    rng = random.Random(f"multi-turn:{seed}")
    sessions: list[Session] = []
    remaining = num_requests
    while remaining > 0:
        num_turns = min(remaining, rng.randint(1, MULTI_TURN_MAX_TURNS))
        turns = [
            Turn(
                _tokens(rng, rng.randint(*MULTI_TURN_USER_LEN), vocab_size),
                _cap(rng.randint(*MULTI_TURN_OUTPUT_LEN), max_tokens_cap),
            )
            for _ in range(num_turns)
        ]
        sessions.append(Session(f"chat-{len(sessions)}", turns))
        remaining -= num_turns
    return Workload("multi-turn", sessions)


def cold_warm(
    num_requests: int, vocab_size: int, seed: int, max_tokens_cap: int | None = None
) -> tuple[Workload, Workload]:
    """The shared-prefix requests twice: cold, each with its own cache salt so nothing is
    reused; warm, in one namespace primed beforehand with the system prompt."""
    base = shared_prefix(num_requests, vocab_size, seed, max_tokens_cap)
    cold = [
        Session(s.session_id + "-cold", s.turns, cache_salt=f"bench-cold-{seed}-{s.session_id}") for s in base.sessions
    ]
    warm_salt = f"bench-warm-{seed}"
    warm = [Session(s.session_id + "-warm", s.turns, cache_salt=warm_salt) for s in base.sessions]
    system = base.sessions[0].turns[0].new_token_ids[:SHARED_PREFIX_LEN] if base.sessions else []
    primer = [Session("primer", [Turn(list(system), 1)], cache_salt=warm_salt)] if system else []
    return Workload("cold-warm", cold, phase="cold"), Workload("cold-warm", warm, phase="warm", warmup=primer)


def build(
    name: str,
    num_requests: int,
    vocab_size: int,
    seed: int,
    max_tokens_cap: int | None = None,
    encoder: TextEncoder | None = None,
) -> list[Workload]:
    """The workload(s) called `name`; `cold-warm` yields its cold and warm halves. `copy` needs the
    model's `encoder` (`copy_workload.ModelTextEncoder`)."""
    if name == "copy":
        if encoder is None:
            raise ValueError("the copy workload is text: it needs the model's tokenizer (an encoder)")
        return [copy_workload(num_requests, seed, encoder, max_tokens_cap)]
    if name == "mixed":
        return [mixed(num_requests, vocab_size, seed, max_tokens_cap)]
    if name == "shared-prefix":
        return [shared_prefix(num_requests, vocab_size, seed, max_tokens_cap)]
    if name == "multi-turn":
        return [multi_turn(num_requests, vocab_size, seed, max_tokens_cap)]
    if name == "cold-warm":
        return list(cold_warm(num_requests, vocab_size, seed, max_tokens_cap))
    if name == "multi-prefix":
        return [multi_prefix(num_requests, vocab_size, seed, max_tokens_cap)]
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
