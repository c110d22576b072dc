"""Rank 0 of a tensor-parallel group: the one `Executor` the scheduler's link sees.

Each plan, reset and shutdown is first sent to every other rank (`PlanChannel`), then run here;
every rank then steps through the same forward pass, and only this one samples. A failed
collective ends the group (`LocalRanks.end_group`): it never becomes a step error, since the ranks
can no longer be assumed to agree on their state.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import structlog

from kvserve.executor.link_worker import ExitReason
from kvserve.executor.protocol import Executor
from kvserve.executor.tensor_parallel.group import RankLostError
from kvserve.executor.tensor_parallel.launcher import LocalRanks
from kvserve.executor.tensor_parallel.plan_channel import MessageKind, PlanChannel
from kvserve.protos.step import ExecutorInfo, StepPlan, StepResult

log = structlog.get_logger(__name__)


class TensorParallelExecutor:
    """Satisfies `kvserve.executor.protocol.Executor` for a group of ranks."""

    def __init__(self, runner: Executor, channel: PlanChannel, ranks: LocalRanks | None) -> None:
        self.runner = runner
        """Rank 0's own `ModelRunner` (typed by its protocol: this package does not import the runner)."""
        self.channel = channel
        self.ranks = ranks
        """None when an outside launcher started the other ranks (multi-host)."""
        self.last_send_s = 0.0
        """Encoding and broadcasting the last plan (`kvserve bench executor` reports it)."""
        self.last_plan_bytes = b""
        """The last plan as the other ranks received it (kept, not copied: the bench prices its decode)."""

    def info(self) -> ExecutorInfo:
        return self.runner.info()

    def execute(self, plan: StepPlan) -> StepResult:
        try:
            started = time.perf_counter()
            with self._watched_send():
                self.last_plan_bytes = self.channel.send_plan(plan)
            self.last_send_s = time.perf_counter() - started
            return self.runner.execute(plan)
        except RankLostError as exc:
            self._end_group(exc)

    def reset(self) -> None:
        try:
            with self._watched_send():
                self.channel.send(MessageKind.RESET)
        except RankLostError as exc:
            self._end_group(exc)
        self.runner.reset()

    def load_adapter(self, name: str, path: str) -> list[str]:
        return self.runner.load_adapter(name, path)  # refused: LoRA runs on one executor

    def unload_adapter(self, name: str) -> list[str]:
        return self.runner.unload_adapter(name)

    def close(self) -> None:
        if self.ranks is not None:
            self.ranks.expect_exit()
        try:
            with self._watched_send():  # a hung rank would hold this broadcast: the watch kills it
                self.channel.send(MessageKind.SHUTDOWN)
        except RankLostError as exc:
            log.warning("tensor-parallel ranks gone before shutdown", error=str(exc))
        if self.ranks is not None:
            self.ranks.stop()
        self.runner.close()

    @contextmanager
    def _watched_send(self) -> Iterator[None]:
        """A broadcast the launcher's watch ends the group over if it outlasts `--tp-timeout-s`."""
        if self.ranks is None:
            yield
            return
        self.ranks.sending_since = time.monotonic()
        try:
            yield
        finally:
            self.ranks.sending_since = None

    def _end_group(self, exc: RankLostError) -> NoReturn:
        if self.ranks is not None:
            self.ranks.end_group("a collective failed", error=str(exc))
        log.error("tensor-parallel group lost; exiting for a restart", error=str(exc))
        os._exit(int(ExitReason.RANK_LOST))
