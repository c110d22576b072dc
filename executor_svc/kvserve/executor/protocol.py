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

    def load_adapter(self, name: str, path: str) -> list[str]:
        """Load the PEFT adapter in `path` as `name`, between steps; the adapters loaded now, in order.
        ExecutorConfigError names why it was refused, and then nothing changed."""
        ...

    def unload_adapter(self, name: str) -> list[str]:
        """Unload the adapter `name`; the adapters loaded now (ExecutorConfigError when it is not loaded).
        The scheduler unloads no adapter a request in flight runs under (`AdapterCatalog.unload`); a
        finished sequence the executor still holds (its drop comes with the next plan) never runs again."""
        ...

    def close(self) -> None:
        """Release resources; the process is about to exit."""
        ...
