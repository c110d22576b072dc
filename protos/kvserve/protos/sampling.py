"""Per-request sampling parameters, shared by the scheduler (stop rules) and the executor (sampling).

Frozen: the API edge parses a request into one of these once, and from then on the
scheduler, the step codec and the executor only read it. `validate()` is the single
definition of the value ranges; the API edge calls it to refuse a request, naming the
offending field so the client gets INVALID_ARGUMENT with a useful message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvserve.config import defaults


class InvalidFieldError(ValueError):
    """A request field holds a value kvserve refuses. `field` is the API field name."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.reason = message


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    `top_k = -1` and `top_p = 1.0` and `min_p = 0.0` switch those filters off. The API also
    takes `top_k = 0` as off; request parsing stores it as -1, so -1 is the one off value here
    (and in the executor's sampler).
    `temperature = 0` means greedy (argmax). `seed = None` asks the scheduler to
    pick one at admission, so a recompute after preemption draws the same tokens.
    `logprobs = None` returns none; `0` returns the sampled token's logprob only;
    `k > 0` adds the top-k alternatives.
    `logit_bias` is OpenAI's token id -> bias map, as (token id, bias) pairs sorted by id, each id
    once (a tuple, so the params stay hashable): the executor adds each bias to its token's logit
    after the penalties, and a bias of -MAX_ABS_LOGIT_BIAS (-100) bans the token.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidFieldError naming the first field whose value is out of range; with
        `vocab_size`, also a `logit_bias` token id outside the model's vocabulary."""
        _finite_in("temperature", self.temperature, 0.0, 100.0)
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            raise InvalidFieldError("top_k", f"must be -1 (off) or a positive integer, got {self.top_k}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidFieldError("top_p", f"must be in (0, 1], got {self.top_p}")
        _finite_in("min_p", self.min_p, 0.0, 1.0)
        if not _finite(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidFieldError("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        _finite_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _finite_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None and not 0 <= self.seed <= defaults.MAX_SEED:
            raise InvalidFieldError("seed", f"must be in [0, {defaults.MAX_SEED}], got {self.seed}")
        if not 1 <= self.n <= defaults.MAX_N:
            raise InvalidFieldError("n", f"must be in [1, {defaults.MAX_N}], got {self.n}")
        if self.max_tokens < 1:
            raise InvalidFieldError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidFieldError(
                "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if len(self.stop_token_ids) > defaults.MAX_STOP_TOKEN_IDS:
            raise InvalidFieldError("stop_token_ids", f"at most {defaults.MAX_STOP_TOKEN_IDS} allowed")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidFieldError("stop_token_ids", "token ids must be non-negative")
        if len(self.stop) > defaults.MAX_STOP_STRINGS:
            raise InvalidFieldError("stop", f"at most {defaults.MAX_STOP_STRINGS} stop strings allowed")
        for s in self.stop:
            if not s:
                raise InvalidFieldError("stop", "stop strings must not be empty")
            if len(s) > defaults.MAX_STOP_STRING_CHARS:
                raise InvalidFieldError(
                    "stop", f"each stop string must be at most {defaults.MAX_STOP_STRING_CHARS} characters"
                )
        if self.logprobs is not None and not 0 <= self.logprobs <= defaults.MAX_LOGPROBS:
            raise InvalidFieldError("logprobs", f"must be in [0, {defaults.MAX_LOGPROBS}], got {self.logprobs}")
        validate_logit_bias(self.logit_bias, vocab_size)


def validate_logit_bias(logit_bias: tuple[tuple[int, float], ...], vocab_size: int | None = None) -> None:
    """The one definition of `logit_bias`'s limits: at most MAX_LOGIT_BIAS_ENTRIES entries, token ids
    sorted and unique in [0, vocab_size), biases finite in [-MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS]."""
    limit = defaults.MAX_ABS_LOGIT_BIAS
    if len(logit_bias) > defaults.MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidFieldError(
            "logit_bias", f"at most {defaults.MAX_LOGIT_BIAS_ENTRIES} entries allowed, got {len(logit_bias)}"
        )
    previous = -1
    for token, bias in logit_bias:
        if isinstance(token, bool) or not isinstance(token, int):
            raise InvalidFieldError("logit_bias", f"token ids must be integers, got {token!r}")
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            vocab = f" [0, {vocab_size})" if vocab_size is not None else ""
            raise InvalidFieldError("logit_bias", f"token id {token} is outside the vocabulary{vocab}")
        if token <= previous:
            raise InvalidFieldError("logit_bias", f"token id {token} is listed twice or out of order")
        previous = token
        if isinstance(bias, bool) or not _finite(bias) or not -limit <= bias <= limit:
            raise InvalidFieldError(
                "logit_bias", f"the bias of token {token} must be a number in [{-limit:g}, {limit:g}], got {bias!r}"
            )


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _finite_in(name: str, x: float, lo: float, hi: float) -> None:
    if not _finite(x) or not lo <= x <= hi:
        raise InvalidFieldError(name, f"must be a finite number in [{lo}, {hi}], got {x}")
