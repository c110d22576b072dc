"""How a call over the executor link fails: the executor is gone, it refused one step, or it refused
a LoRA adapter change (`AdapterRefused`: the user's input, and nothing changed).

The two call for different recoveries, so the engine tells them apart by type: `ExecutorLost`
(died, hung, replaced, or the link closed) means its state is gone and every sequence must be
recomputed on the next executor; `ExecutorStepError` means it is alive and failed this step, so
the requests of the step fail and the executor is reset. Apart from `connection.ExecutorLink` so
that what the link raises can be caught without reading how the link works.
"""

from __future__ import annotations


class ExecutorLost(RuntimeError):
    """The executor died, hung, or was replaced while this call waited on it."""


class ExecutorStepError(RuntimeError):
    """The executor reported an error for this step; it is still alive."""

    def __init__(self, step_id: int, message: str, error_type: str = "") -> None:
        super().__init__(f"executor failed step {step_id}: {error_type + ': ' if error_type else ''}{message}")
        self.step_id = step_id
        self.error_type = error_type


class AdapterRefused(RuntimeError):
    """The executor refused to load or unload a LoRA adapter; the message says why, and nothing changed."""
