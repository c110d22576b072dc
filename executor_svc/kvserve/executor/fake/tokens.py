"""The fake executor's token function, and what a run of it must produce.

A token is a hash of the last few context tokens, the context length, (when sampling)
the seed and the sequence's LoRA adapter (`adapters.lora_salt`, 0 for the base model): it
depends on nothing else, so recompute, swap and restarts reproduce outputs,
and a test can compute a sequence's expected completion without running any executor.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Iterable, Sequence

from kvserve.config import defaults
from kvserve.executor.fake.adapters import lora_salt
from kvserve.protos.step import TokenLogprob

DEFAULT_CONTEXT_WINDOW = 4
"""How many trailing context tokens the next token depends on."""
_MASK64 = (1 << 64) - 1


def hash_ints(values: Iterable[int], length: int, salt: int) -> int:
    """A 64-bit mix (splitmix64 finalizer per value): stable across processes and platforms."""
    h = (length * 0x9E3779B97F4A7C15 + salt) & _MASK64
    for v in values:
        h = (h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 31
    return h


def context_hash(window: Sequence[int], length: int, seed: int, greedy: bool, lora: int = 0) -> int:
    """The draw for the next token: greedy ignores the seed, as argmax would; an adapter's salt `lora`
    changes every draw (0, the base model, none)."""
    return hash_ints(window, length, (0 if greedy else seed + 1) ^ lora)


def pick_token(h: int, samplable: Sequence[int]) -> int:
    return samplable[h % len(samplable)]


def copied_token(context: Sequence[int], period: int, samplable: Container[int]) -> int | None:
    """A copying model's greedy token: the context token `period` positions back, if it is ordinary.

    Speculative decoding's tests need a model whose output follows its input, as text
    rewriting does, so that lookup drafts are accepted; hashed tokens almost never are.
    """
    if period <= 0 or len(context) < period:
        return None
    token = context[-period]
    return token if token in samplable else None


def copies(h: int, greedy: bool) -> bool:
    """Whether a copying model copies this draw: always when greedy; three draws in four (by the
    draw's hash) when sampling, so a seeded request both accepts and rejects drafts."""
    return greedy or h % 4 != 0


def allowed_token_ids(row: bytes) -> list[int]:
    """The token ids a structured-output mask row allows (little-endian uint32 words, bit t % 32 of word t // 32)."""
    allowed = []
    for index in range(0, len(row), 4):
        word = int.from_bytes(row[index : index + 4], "little")
        base = index * 8
        while word:
            low = word & -word
            allowed.append(base + low.bit_length() - 1)
            word ^= low
    return allowed


def pick_allowed(h: int, allowed: Sequence[int], samplable: frozenset[int]) -> int:
    """The draw within a mask: an ordinary token the mask allows, else the mask's first (e.g. eos at the end)."""
    ordinary = [t for t in allowed if t in samplable]
    if ordinary:
        return ordinary[h % len(ordinary)]
    if not allowed:
        raise ValueError("the token mask allows no token")
    return allowed[0]


def biased_token(
    token: int,
    h: int,
    logit_bias: Iterable[tuple[int, float]],
    allowed: Collection[int] | None,
    fallback: Sequence[int],
    held_back: Container[int],
) -> int:
    """The fake model's answer to `logit_bias`, given its drawn `token`: the token with the highest
    positive bias, the lowest id on a tie; else `token`, unless it is banned (-100), then a draw by `h`
    among the `fallback` tokens that are not. Only tokens the mask `allowed` (None: all) and not
    `held_back` (stop tokens before min_tokens) can win a bias; with every fallback banned, `token` stays
    (the grammar wins, as in the real sampler)."""
    ban = -defaults.MAX_ABS_LOGIT_BIAS
    favoured = [
        (-bias, t) for t, bias in logit_bias if bias > 0 and (allowed is None or t in allowed) and t not in held_back
    ]
    if favoured:
        return min(favoured)[1]
    banned = {t for t, bias in logit_bias if bias <= ban}
    if token not in banned:
        return token
    rest = [t for t in fallback if t not in banned]
    return rest[h % len(rest)] if rest else token


def wants_eos(h: int, probability: float) -> bool:
    """Whether this draw is eos, deterministic per context; the caller decides if eos may come."""
    return probability > 0.0 and hash_ints([h], 0x5EED, 0) % 1_000_000 < probability * 1_000_000


def fake_logprob(h: int) -> float:
    return -0.001 - ((h >> 17) % 4000) / 1000.0  # in (-4.001, -0.001]


def top_logprobs(h: int, token: int, logprob: float, k: int, samplable: Sequence[int]) -> list[TokenLogprob]:
    """The sampled token first, then k-1 made-up alternatives with lower logprobs."""
    if k <= 0:
        return []
    top = [TokenLogprob(token, logprob)]
    for i in range(1, k):
        top.append(TokenLogprob(pick_token(hash_ints([h, i], 0, 0), samplable), logprob - 0.5 * i))
    return top


def expected_completion(
    prompt: Iterable[int],
    seed: int,
    max_tokens: int,
    vocab_size: int = 50,
    stop_ids: Iterable[int] = (),
    *,
    greedy: bool = False,
    context_window: int = DEFAULT_CONTEXT_WINDOW,
    copy_period: int = 0,
    lora_name: str = "",
) -> list[int]:
    """What an undisturbed run of one sequence yields on a fake executor whose vocabulary is
    plain `range(vocab_size)` (strict mode without a tokenizer; 50 is the scheduler tests' size),
    under the LoRA adapter `lora_name` ("": the base model)."""
    tokens = list(prompt)
    samplable = range(vocab_size)
    stop = set(stop_ids)
    salt = lora_salt(lora_name)
    out: list[int] = []
    while len(out) < max_tokens:
        h = context_hash(tokens[-context_window:], len(tokens), seed, greedy, salt)
        token = copied_token(tokens, copy_period, samplable) if copies(h, greedy) else None
        if token is None:
            token = pick_token(h, samplable)
        tokens.append(token)
        out.append(token)
        if token in stop:
            break
    return out
