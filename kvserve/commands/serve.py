"""`kvserve serve`: the scheduler plus a supervised executor child, one command line.

The executor runs as `python -m kvserve.executor ...` in its own process; if it dies, it is
restarted and the scheduler re-syncs it, so in-flight requests complete. No flag is declared
here: each is generated (kvserve.config.flags) from a config dataclass, with its default and
help. They are the scheduler's `ServerConfig` (its scheduling policy the core's own
`SchedulerConfig`), the executor's configs exactly as `kvserve executor` takes them
(kvserve.executor.entry.add_arguments) less what serve sets for its child itself
(`SET_BY_SERVE`), the replicas' `DataParallelConfig` and this command's `ServeConfig`.
`executor_args` hands the executor's configs to the child as `kvserve executor` flags.

The scheduler runs in this process: importing this module loads nothing of kvserve.executor, and
parsing loads only the executor's config modules, which load no torch (tests/services/test_import_rules.py).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.config.flags import HelpFormatter, add_flags, config_from_args, config_to_argv, flag, sections

if TYPE_CHECKING:
    from kvserve.executor.entry import EntryOptions
    from kvserve.executor.fake.executor import FakeExecutorConfig
    from kvserve.executor.link_worker import LinkWorkerConfig
    from kvserve.executor.runner_config import RunnerConfig
    from kvserve.executor.tensor_parallel.config import TensorParallelConfig
    from kvserve.replicas.replica_plan import DataParallelConfig, ExecutorShape
    from kvserve.scheduler.server.server_config import ServerConfig

_EXECUTOR = "executor"

SET_BY_SERVE = (
    "endpoint",
    "allow_remote",
    "heartbeat_interval_s",
    "reregister",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
)
"""The `kvserve executor` options serve does not take: it gives its child the link it binds,
with the scheduler's --heartbeat-interval-s and --allow-remote-link, and the budgets the scheduler
plans with (its --max-num-batched-tokens, --max-num-seqs and --max-model-len); a supervised child
never outlives its scheduler, so never re-registers."""

_CHILD_CURVE = {"curve_secret_key": "executor_curve_secret_key", "curve_server_key": "executor_curve_server_key"}
"""The executor's CURVE flags, which the scheduler has under the same names, by the dest serve gives them."""


def _spelling() -> dict[str, dict[str, Any]]:
    """How serve's parser spells and groups the executor's flags, where not as `kvserve executor` does."""
    from kvserve.scheduler.server.server_config import LINK_SECTION

    spelling: dict[str, dict[str, Any]] = {
        "executor": {"group": _EXECUTOR},
        "scheduler_timeout_s": {"group": LINK_SECTION},
        "connect_timeout_s": {"group": LINK_SECTION},
    }
    for name, dest in _CHILD_CURVE.items():
        spelling[name] = {"flag": "--" + dest.replace("_", "-"), "dest": dest, "group": LINK_SECTION}
    return spelling


@dataclass(slots=True)
class ServeConfig:
    """This command's own options."""

    executor_restart: bool = field(
        default=True,
        metadata=flag(
            "restarting the executor when it dies; without it requests fail after the restart timeout", group=_EXECUTOR
        ),
    )


@dataclass(slots=True)
class ChildExecutor:
    """The supervised executor's configs as serve's flags set them. `executor_args` fills in what serve
    sets itself (`SET_BY_SERVE`: `link.endpoint` is empty until then) and writes them as its flags."""

    options: EntryOptions
    runner: RunnerConfig
    parallel: TensorParallelConfig
    fake: FakeExecutorConfig
    link: LinkWorkerConfig

    def shape(self) -> ExecutorShape:
        """What the replica plan of --data-parallel-size reads."""
        from kvserve.replicas.replica_plan import ExecutorShape

        return ExecutorShape(
            kind=self.options.executor,
            tensor_parallel_size=self.parallel.tensor_parallel_size,
            block_size=self.runner.block_size,
            device=self.runner.device,
            num_threads=self.runner.num_threads,
        )


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.executor import entry
    from kvserve.replicas import replica_plan
    from kvserve.replicas.replica_plan import DataParallelConfig
    from kvserve.scheduler.server import server_config
    from kvserve.scheduler.server.server_config import ServerConfig

    parser = subparsers.add_parser(
        "serve",
        help="serve a model: scheduler + supervised executor (gRPC on 127.0.0.1:50051)",
        description="Start the executor as a supervised child process and the scheduler with its gRPC API. "
        "Prints where it listens once healthy. Stop with Ctrl-C or SIGTERM (drains first). Takes the flags "
        "of `kvserve executor` (less the link and the budgets, which it sets for its child from its own) "
        "and of `kvserve scheduler`.",
        formatter_class=HelpFormatter,
    )
    sections(parser, (_EXECUTOR, *entry.SECTIONS, replica_plan.SECTION, *server_config.SECTIONS))
    add_flags(parser, ServerConfig)
    entry.add_arguments(parser, leave_out=SET_BY_SERVE, overrides=_spelling())
    add_flags(parser, ServeConfig)
    add_flags(parser, DataParallelConfig)
    parser.set_defaults(func=run)


def child_executor_from_args(args: argparse.Namespace) -> ChildExecutor:
    """The executor's configs from serve's parsed flags; ValueError for a value one of them refuses."""
    from kvserve.executor.entry import NOT_FLAGS, SHARED_WITH_FAKE, EntryOptions
    from kvserve.executor.fake.executor import FakeExecutorConfig
    from kvserve.executor.link_worker import LinkWorkerConfig
    from kvserve.executor.runner_config import RunnerConfig
    from kvserve.executor.tensor_parallel.config import TensorParallelConfig

    runner = config_from_args(RunnerConfig, args)
    return ChildExecutor(
        options=config_from_args(
            EntryOptions, args, **{name: getattr(args, dest) for name, dest in _CHILD_CURVE.items()}
        ),
        runner=runner,
        parallel=config_from_args(TensorParallelConfig, args),
        fake=config_from_args(FakeExecutorConfig, args, **{name: getattr(runner, name) for name in SHARED_WITH_FAKE}),
        link=config_from_args(
            LinkWorkerConfig,
            args,
            endpoint="",
            allow_remote=False,
            reregister=False,
            **dict.fromkeys(NOT_FLAGS),
        ),
    )


def executor_args(child: ChildExecutor, server: ServerConfig, endpoint: str) -> list[str]:
    """`kvserve executor` options for the supervised child: its configs, with what serve sets itself."""
    link = dataclasses.replace(
        child.link,
        endpoint=endpoint,
        allow_remote=server.allow_remote_link,
        heartbeat_interval_s=server.heartbeat_interval_s,
    )
    # the executor sizes its buffers for the same budgets the scheduler will plan with
    runner = dataclasses.replace(
        child.runner,
        max_num_batched_tokens=server.scheduling.max_num_batched_tokens,
        max_num_seqs=server.scheduling.max_num_seqs,
        max_model_len=server.max_model_len,
    )
    return _argv(dataclasses.replace(child, runner=runner, link=link), exclude=())


def serve_argv(serve: ServeConfig, child: ChildExecutor) -> list[str]:
    """This command's own and its executor's options as `kvserve serve` flags (for its replicas)."""
    return [*config_to_argv(serve), *_argv(child, exclude=SET_BY_SERVE, overrides=_spelling())]


def _argv(
    child: ChildExecutor, *, exclude: tuple[str, ...], overrides: dict[str, dict[str, Any]] | None = None
) -> list[str]:
    from kvserve.executor.entry import NOT_FLAGS, SHARED_WITH_FAKE

    return [
        *config_to_argv(child.options, overrides=overrides),
        *config_to_argv(child.link, exclude=(*exclude, *NOT_FLAGS)),
        *config_to_argv(child.runner, exclude=exclude),
        *config_to_argv(child.parallel),
        *config_to_argv(child.fake, exclude=SHARED_WITH_FAKE),
    ]


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    from kvserve.log_config import configure_logging
    from kvserve.replicas.replica_plan import DataParallelConfig
    from kvserve.scheduler.server.executor_link.child_supervisor import ChildSupervisor, executor_command
    from kvserve.scheduler.server.server_config import ServerConfig
    from kvserve.scheduler.server.service import resolve_link_endpoint, run_service

    try:
        serve = config_from_args(ServeConfig, args)
        child = child_executor_from_args(args)
        config = config_from_args(ServerConfig, args)
        dp = config_from_args(DataParallelConfig, args)
    except ValueError as exc:  # a config's own check (the executor's would refuse it at start)
        print(f"kvserve serve: {exc}", file=sys.stderr)
        return 2
    if dp.data_parallel_size != 1:
        configure_logging(process="replica-set")
        return run_replicas(serve, child, config, dp)
    configure_logging(process="scheduler")
    endpoint = resolve_link_endpoint(config)
    supervisor = ChildSupervisor(
        executor_command(executor_args(child, config, endpoint)), restart=serve.executor_restart
    )
    return asyncio.run(run_service(config, endpoint=endpoint, supervisor=supervisor))


def run_replicas(serve: ServeConfig, child: ChildExecutor, config: ServerConfig, dp: DataParallelConfig) -> int:
    """`--data-parallel-size N`: N replicas of this very command line behind vllm-router."""
    import sys

    from kvserve.replicas.replica_plan import ReplicaPlanError, plan_replicas
    from kvserve.replicas.replica_set import run_replica_set
    from kvserve.replicas.router_command import ROUTER_MISSING, find_router

    router = find_router()
    if router is None:
        print(f"kvserve: {ROUTER_MISSING}", file=sys.stderr)
        return 2
    try:
        plan = plan_replicas(dp, config, serve_argv(serve, child), child.shape())
    except ReplicaPlanError as exc:
        print(f"kvserve: {exc}", file=sys.stderr)
        return 2
    if config.auth_token_file is not None and dp.router_policy == "kv_aware":
        print(
            "kvserve: warning: with --auth-token-file the router's own /tokenize calls are refused, so kv_aware "
            "routes without prefix knowledge; consider --router-policy consistent_hash (docs/scale-out.md)",
            file=sys.stderr,
        )
    return run_replica_set(plan, router, drain_grace_s=config.drain_grace_s)
