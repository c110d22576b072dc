"""Fault injection (tests only): how the fake executor misbehaves when a `--fault-...` option tells it to.

The scheduler must survive an executor that breaks its contract; these make the fake break it on
purpose, deterministically, so a test can watch the server's defence over real processes.
`--fault-violate-token-masks`: under a structured-output mask, draw a token the mask forbids
(the scheduler fails the request with an internal error and carries on serving).
"""

from __future__ import annotations

from collections.abc import Sequence


def forbidden_token(h: int, allowed: Sequence[int], samplable: Sequence[int]) -> int | None:
    """An ordinary token the mask does not allow, chosen by the draw's hash `h`; None if it allows them all."""
    permitted = set(allowed)
    start = h % len(samplable)
    for i in range(len(samplable)):
        token = samplable[(start + i) % len(samplable)]
        if token not in permitted:
            return token
    return None
