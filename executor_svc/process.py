"""The executor process: build an executor, register with the scheduler, serve plans.

executor_svc.entry parses flags into the configs below and calls `run_executor`. The torch
model runner is imported only for `--executor torch`, so a fake executor process never
imports torch (and starts in well under a second).
"""

from __future__ import annotations

import structlog

from executor_svc.fake_executor import FakeExecutor, FakeExecutorConfig
from executor_svc.link_worker import LinkWorker, LinkWorkerConfig
from executor_svc.protocol import Executor
from executor_svc.runner_config import RunnerConfig

log = structlog.get_logger(__name__)

EXECUTOR_KINDS = ("torch", "fake")


def build_executor(
    kind: str, *, runner: RunnerConfig | None = None, fake: FakeExecutorConfig | None = None
) -> Executor:
    """The executor named by `--executor`, configured and ready to run plans."""
    if kind == "fake":
        return FakeExecutor(fake or FakeExecutorConfig())
    if kind == "torch":
        from executor_svc.model_runner import ModelRunner  # imports torch

        return ModelRunner(runner or RunnerConfig())
    raise ValueError(f"unknown executor kind {kind!r}; choose one of {', '.join(EXECUTOR_KINDS)}")


def run_executor(
    kind: str, link: LinkWorkerConfig, *, runner: RunnerConfig | None = None, fake: FakeExecutorConfig | None = None
) -> int:
    """Serve until the scheduler says stop or vanishes; returns the process exit code."""
    executor = build_executor(kind, runner=runner, fake=fake)
    info = executor.info()
    log.info(
        "executor ready",
        kind=kind,
        model_id=info.model_id,
        num_blocks=info.num_blocks,
        block_size=info.block_size,
        endpoint=link.endpoint,
    )
    server = LinkWorker(executor, link)
    server.install_signal_handlers()
    try:
        reason = server.serve()
    finally:
        executor.close()
    log.info("executor exiting", reason=reason.name, code=int(reason))
    return int(reason)
