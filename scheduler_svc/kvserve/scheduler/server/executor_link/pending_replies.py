"""What the link's callers await from the executor: step results by step id, reset acknowledgements,
the adapters loaded after a LoRA load or unload.

Each step in flight has a future and the moment its plan was sent (the step timeout counts from
it); each reset has a future under the id its `Reset` carries. A reply settles its future once,
a reply nobody waits for is ignored, and a lost executor fails every future at once. Apart from
`connection.ExecutorLink`, which owns the socket and the peer, so the bookkeeping of who waits for
what reads in one place.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from kvserve.protos.step import StepResult
from kvserve.scheduler.server.executor_link.link_errors import AdapterRefused, ExecutorLost, ExecutorStepError

log = structlog.get_logger(__name__)


class PendingReplies:
    """The futures of the steps, resets and adapter changes in flight on the current executor."""

    def __init__(self) -> None:
        self._steps: dict[int, tuple[asyncio.Future[StepResult], float]] = {}
        """step_id -> (future of its result, when it was sent)."""
        self._resets: dict[int, asyncio.Future[None]] = {}
        self._next_reset_id = 1
        self._adapter_changes: dict[int, asyncio.Future[list[str]]] = {}
        self._next_command_id = 1

    # --- steps -----------------------------------------------------------------

    def awaits_step(self, step_id: int) -> bool:
        return step_id in self._steps

    def expect_step(self, step_id: int) -> asyncio.Future[StepResult]:
        """A future for this step's result, its clock started now."""
        future: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        self._steps[step_id] = (future, time.monotonic())
        return future

    def forget_step(self, step_id: int) -> None:
        self._steps.pop(step_id, None)

    def oldest_step_sent_at(self) -> float | None:
        """When the longest-waiting step was sent; None with no step in flight."""
        return min((sent_at for _, sent_at in self._steps.values()), default=None)

    def overdue_step(self, now: float, timeout_s: float) -> int | None:
        """The first step (in sending order) that has waited longer than `timeout_s`, if any."""
        for step_id, (_, sent_at) in self._steps.items():
            if now - sent_at > timeout_s:
                return step_id
        return None

    def resolve_step(self, step_id: int, decode: Callable[[], StepResult]) -> None:
        """Settle a step with its decoded result; a malformed one fails it with ExecutorStepError."""
        entry = self._steps.get(step_id)
        if entry is None:
            log.debug("ignoring a result nobody waits for", step_id=step_id)
            return
        future = entry[0]
        if future.done():
            return
        try:
            future.set_result(decode())
        except ValueError as exc:
            future.set_exception(ExecutorStepError(step_id, f"malformed result: {exc}", "DecodeError"))

    def fail_step(self, step_id: int, exc: Exception) -> None:
        entry = self._steps.get(step_id)
        if entry is not None and not entry[0].done():
            entry[0].set_exception(exc)

    # --- resets ----------------------------------------------------------------

    def expect_reset(self) -> tuple[int, asyncio.Future[None]]:
        """A new reset's id and the future its acknowledgement settles."""
        reset_id = self._next_reset_id
        self._next_reset_id += 1
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._resets[reset_id] = future
        return reset_id, future

    def forget_reset(self, reset_id: int) -> None:
        self._resets.pop(reset_id, None)

    def resolve_reset(self, reset_id: int) -> None:
        future = self._resets.get(reset_id)
        if future is not None and not future.done():
            future.set_result(None)

    # --- LoRA adapter changes -------------------------------------------------------

    def expect_adapter_change(self) -> tuple[int, asyncio.Future[list[str]]]:
        """A new load's or unload's command id and the future its answer settles."""
        command_id = self._next_command_id
        self._next_command_id += 1
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        self._adapter_changes[command_id] = future
        return command_id, future

    def forget_adapter_change(self, command_id: int) -> None:
        self._adapter_changes.pop(command_id, None)

    def resolve_adapter_change(self, command_id: int, error: str, lora_names: list[str]) -> None:
        """Settle a load or unload: the adapters loaded now, or AdapterRefused with the executor's reason."""
        future = self._adapter_changes.get(command_id)
        if future is None or future.done():
            return
        if error:
            future.set_exception(AdapterRefused(error))
        else:
            future.set_result(lora_names)

    # --- all --------------------------------------------------------------------

    def fail_all(self, exc: ExecutorLost) -> None:
        """The executor is gone: every step and reset in flight fails with `exc`."""
        for future, _ in self._steps.values():
            if not future.done():
                future.set_exception(exc)
        waiters: list[asyncio.Future] = [*self._resets.values(), *self._adapter_changes.values()]
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(exc)
