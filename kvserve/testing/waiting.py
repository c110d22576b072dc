"""Wait for an event, not for a length of time: poll a condition until it holds or a generous deadline passes.

A test that sleeps and then asserts measures the machine, not the code: on a loaded box the event comes
late and the test fails, or the check runs before anything happened and passes for nothing. These
helpers poll instead, return as soon as the condition holds, and fail with a message that names what
was awaited and for how long, so the deadline only bounds a stuck system and can be set generously.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

T = TypeVar("T")

POLL_INTERVAL_S = 0.02
"""Short enough that an event is seen promptly, long enough not to compete with what is awaited."""


class WaitTimedOut(AssertionError):
    """The condition never held before the deadline; an AssertionError so pytest reports it as a failure."""


def _failure(what: str | Callable[[], str], timeout_s: float, last: object) -> WaitTimedOut:
    described = what() if callable(what) else what
    return WaitTimedOut(f"timed out after {timeout_s:g}s waiting for {described} (last value: {last!r})")


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str | Callable[[], str],
    *,
    interval_s: float = POLL_INTERVAL_S,
) -> T:
    """`predicate()`'s first truthy value, polled every `interval_s`; WaitTimedOut after `timeout_s`.

    `what` names the awaited event in the failure message; a callable is asked only on failure (a log tail).
    The predicate is always tried once more at the deadline, so a late check never fails a met condition.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _failure(what, timeout_s, value)
        time.sleep(interval_s)


async def wait_until_async(
    predicate: Callable[[], T | Awaitable[T]],
    timeout_s: float,
    what: str | Callable[[], str],
    *,
    interval_s: float = POLL_INTERVAL_S,
) -> T:
    """`wait_until` for a coroutine: yields to the event loop between polls; `predicate` may be async."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return cast(T, value)
        if time.monotonic() >= deadline:
            raise _failure(what, timeout_s, value)
        await asyncio.sleep(interval_s)
