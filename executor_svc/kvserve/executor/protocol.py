"""The one interface every executor implementation satisfies.

`kvserve.executor.link_worker` drives any `Executor` from StepPlans received over ZeroMQ:
the real torch model runner and the fake executor used by fast tests plug in the same way.
"""

from __future__ import annotations

from typing import Protocol

from kvserve.protos.step import ExecutorInfo, StepPlan, StepResult


class Executor(Protocol):
    def info(self) -> ExecutorInfo:
        """Model identity and KV geometry, reported to the scheduler at the handshake."""
        ...

    def execute(self, plan: StepPlan) -> StepResult:
        """Apply the plan's drops and block ops, run the forward pass, sample."""
        ...

    def reset(self) -> None:
        """Forget every sequence (scheduler re-sync). KV contents may be left as garbage."""
        ...

    def close(self) -> None:
        """Release resources; the process is about to exit."""
        ...
