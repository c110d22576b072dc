"""The executor process: build an executor, register with the scheduler, serve plans.

kvserve.executor.entry parses flags into the configs below and calls `run_executor`. The torch
model runner is imported only for `--executor torch`, so a fake executor process never
imports torch (and starts in well under a second). With `--tensor-parallel-size N` above 1 this
process is one rank of a group (`run_tensor_parallel`): rank 0 is the executor the scheduler sees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from kvserve.executor.fake.executor import FakeExecutor, FakeExecutorConfig
from kvserve.executor.link_worker import ExitReason, LinkWorker, LinkWorkerConfig
from kvserve.executor.protocol import Executor
from kvserve.executor.runner_config import RunnerConfig
from kvserve.executor.tensor_parallel.config import RankPlace, TensorParallelConfig, check_rank_device, place_from_env

if TYPE_CHECKING:
    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.tensor_parallel.launcher import LocalRanks
    from kvserve.executor.tensor_parallel.leader import TensorParallelExecutor

log = structlog.get_logger(__name__)

EXECUTOR_KINDS = ("torch", "fake")


def build_executor(
    kind: str, *, runner: RunnerConfig | None = None, fake: FakeExecutorConfig | None = None
) -> Executor:
    """The executor named by `--executor`, configured and ready to run plans."""
    if kind == "fake":
        return FakeExecutor(fake or FakeExecutorConfig())
    if kind == "torch":
        from kvserve.executor.model_runner import ModelRunner  # imports torch

        return ModelRunner(runner or RunnerConfig())
    raise ValueError(f"unknown executor kind {kind!r}; choose one of {', '.join(EXECUTOR_KINDS)}")


def run_executor(
    kind: str, link: LinkWorkerConfig, *, runner: RunnerConfig | None = None, fake: FakeExecutorConfig | None = None
) -> int:
    """Serve until the scheduler says stop or vanishes; returns the process exit code."""
    return serve_link(build_executor(kind, runner=runner, fake=fake), link, kind)


def serve_link(executor: Executor, link: LinkWorkerConfig, kind: str) -> int:
    info = executor.info()
    log.info(
        "executor ready",
        kind=kind,
        model_id=info.model_id,
        num_blocks=info.num_blocks,
        block_size=info.block_size,
        device=info.device,
        num_threads=info.num_threads or None,
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


def run_tensor_parallel(
    link: LinkWorkerConfig, runner: RunnerConfig, parallel: TensorParallelConfig, parent_pid: int | None
) -> int:
    """One rank of a tensor-parallel group. Without a place in the environment this process is rank 0
    and starts the others on this host; rank 0 serves the link, the others follow its plans."""
    from kvserve.executor.tensor_parallel.follower import serve_follower, watch_leader
    from kvserve.executor.tensor_parallel.leader import TensorParallelExecutor
    from kvserve.executor.tensor_parallel.plan_channel import PlanChannel

    check_rank_device(runner.device)
    place = place_from_env(parallel.tensor_parallel_size)
    if place is None:
        return serve_link(start_local_group(runner, parallel), link, "torch")
    if place.launched_by_leader and parent_pid is not None:
        watch_leader(parent_pid)
    model = build_rank(runner, place, parallel, None)
    assert model.group is not None
    channel = PlanChannel(model.group)
    if not place.is_leader:
        return serve_follower(model, channel)
    return serve_link(TensorParallelExecutor(model, channel, None), link, "torch")


def start_local_group(runner: RunnerConfig, parallel: TensorParallelConfig) -> TensorParallelExecutor:
    """Rank 0 of a group on this host: refuse a size the model does not fit, start ranks 1 … N−1,
    load this rank's share; returns once every rank has its model and the KV pool is agreed."""
    from kvserve.executor.model_config import load_model_config
    from kvserve.executor.tensor_parallel.launcher import LocalRanks, follower_argv, local_leader_place
    from kvserve.executor.tensor_parallel.layout import check_fits
    from kvserve.executor.tensor_parallel.leader import TensorParallelExecutor
    from kvserve.executor.tensor_parallel.plan_channel import PlanChannel
    from kvserve.executor.weights import model_store
    from kvserve.executor.weights.gguf_q4_1 import GROUP

    size = parallel.tensor_parallel_size
    check_rank_device(runner.device)
    config = load_model_config(model_store.ensure_model_dir(runner.model))
    check_fits(config, size, group_columns=GROUP if runner.weights == "native" else 1)  # before starting anything
    place = local_leader_place(size)
    ranks = LocalRanks(place, follower_argv(runner, parallel), broadcast_timeout_s=parallel.tp_timeout_s)
    ranks.start()
    try:
        model = build_rank(runner, place, parallel, ranks)
    except BaseException:  # a refusal or an error while loading: the ranks started must not wait for us
        ranks.kill_all()
        raise
    assert model.group is not None
    return TensorParallelExecutor(model, PlanChannel(model.group), ranks)


def build_rank(
    runner: RunnerConfig, place: RankPlace, parallel: TensorParallelConfig, ranks: LocalRanks | None
) -> ModelRunner:
    """This rank's model runner; a rank lost while the group forms ends the group like one lost later."""
    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.tensor_parallel.group import RankLostError

    try:
        return ModelRunner(runner, place, parallel)
    except RankLostError as exc:
        if ranks is not None:
            ranks.end_group("a rank was lost while the group formed", error=str(exc))
        log.error("tensor-parallel group lost while forming", rank=place.rank, error=str(exc))
        raise SystemExit(int(ExitReason.RANK_LOST)) from None
