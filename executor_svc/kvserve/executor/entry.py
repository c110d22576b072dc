"""The executor process's command line: flags, configs, `main(argv)`.

`python -m kvserve.executor` (what `kvserve serve` supervises) and `kvserve executor` both
parse here, so the executor never imports the `kvserve` CLI package. Every flag is
generated from a config dataclass (kvserve.config.flags): `LinkWorkerConfig`,
`RunnerConfig`, `TensorParallelConfig`, `FakeExecutorConfig` and this module's
`EntryOptions`, so a new field gets a flag without touching this file, and `kvserve serve`
takes the same flags (`add_arguments` less the ones it sets for its child itself).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvserve.config import defaults
from kvserve.config.flags import HelpFormatter, add_flags, argument_group, config_from_args, flag
from kvserve.executor.config_error import ExecutorConfigError
from kvserve.executor.fake.executor import FakeExecutorConfig
from kvserve.executor.link_worker import ExitReason, LinkWorkerConfig
from kvserve.executor.runner_config import RunnerConfig
from kvserve.executor.tensor_parallel.config import TensorParallelConfig

PROG = "kvserve executor"
DESCRIPTION = (
    "Run the model (or the fake executor) in this process and serve step plans from a "
    "scheduler over ZeroMQ. The executor connects to the scheduler's link endpoint, "
    "exits when the scheduler says so or vanishes, and never outlives it."
)
EPILOG = (
    "exit codes: 0 shut down by the scheduler or by SIGTERM/SIGINT; 3 the scheduler vanished "
    "(silent for --scheduler-timeout-s); 4 no scheduler answered within --connect-timeout-s; "
    "5 a tensor-parallel rank died or hung (the group ended); 2 bad options, or a "
    "--tensor-parallel-size the model does not fit.\n\n"
    "tensor parallelism across hosts: start one `kvserve executor` per rank with RANK, WORLD_SIZE, "
    "LOCAL_RANK, MASTER_ADDR and MASTER_PORT set (as torchrun does) and the same --tensor-parallel-size; "
    "rank 0 connects to the scheduler's --link (docs/tensor-parallel.md)"
)

_LINK = "link"
_RUNNER = "model runner (--executor torch)"
_RUNNER_NOTE = "--model, --block-size and --max-model-len also configure the fake executor"
_FAKE = "fake executor (--executor fake)"
_TENSOR_PARALLEL = fields(TensorParallelConfig)[0].metadata["group"]  # the section its fields name
SECTIONS = (_RUNNER, _FAKE, _TENSOR_PARALLEL)
"""The --help sections of the model's flags, in order (beside the link's and the top-level --executor)."""
SHARED_WITH_FAKE = ("block_size", "max_model_len", "draft_model", "lora", "kv_host_gb", "kv_disk_dir", "kv_disk_gb")
"""FakeExecutorConfig fields read from the runner's flags of the same name."""
NOT_FLAGS = ("curve_keys", "parent_pid")
"""LinkWorkerConfig fields this process sets itself (from the CURVE key files, from the environment)."""


@dataclass(slots=True)
class EntryOptions:
    """The process's options that belong to no component's config."""

    executor: str = field(
        default="torch",
        metadata=flag(
            "torch runs the model; fake emits deterministic tokens without a model (tests)", choices=("torch", "fake")
        ),
    )
    curve_secret_key: str | None = field(
        default=None,
        metadata=flag(
            "this executor's CURVE certificate (NAME.key_secret); turns CURVE on", metavar="FILE", group=_LINK
        ),
    )
    curve_server_key: str | None = field(
        default=None,
        metadata=flag(
            "the scheduler's public CURVE certificate (NAME.key); required with CURVE", metavar="FILE", group=_LINK
        ),
    )


def add_arguments(
    parser: argparse.ArgumentParser,
    *,
    leave_out: Collection[str] = (),
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Every flag of the executor process. `kvserve serve` hangs the same flags into its own parser:
    `leave_out` names the fields it sets for its child itself, and `overrides` (by field name, as in
    `add_flags`) moves some to its sections or respells one its scheduler also has."""
    from kvserve.link.endpoint import default_tcp_endpoint

    overrides = overrides or {}
    argument_group(parser, _LINK)
    argument_group(parser, _RUNNER, _RUNNER_NOTE)
    argument_group(parser, _FAKE)
    sources: list[tuple[type, str | None, Collection[str], dict[str, dict[str, Any]]]] = [
        (LinkWorkerConfig, _LINK, NOT_FLAGS, {"endpoint": {"default": default_tcp_endpoint()}}),
        (EntryOptions, None, (), {}),
        (RunnerConfig, _RUNNER, (), {"model": {"default": defaults.DEFAULT_MODEL}}),
        (TensorParallelConfig, None, (), {}),
        (FakeExecutorConfig, _FAKE, SHARED_WITH_FAKE, {}),
    ]
    unknown = {*leave_out, *overrides} - {f.name for cls, *_ in sources for f in fields(cls)}
    if unknown:
        raise ValueError(f"no executor config has the fields {sorted(unknown)}")
    for cls, group, exclude, own in sources:
        names = {f.name for f in fields(cls)}
        spelled = {name: {**own.get(name, {}), **overrides[name]} for name in names & set(overrides)}
        add_flags(
            parser,
            cls,
            group=group,
            exclude={*exclude, *(names & set(leave_out))},
            overrides={**own, **spelled},
        )


def run(args: argparse.Namespace) -> int:
    from kvserve.executor.process import run_executor
    from kvserve.link.endpoint import LinkEndpointError, check_endpoint
    from kvserve.log_config import configure_logging

    configure_logging(process="executor")
    options = config_from_args(EntryOptions, args)
    try:
        check_endpoint(args.endpoint, allow_remote=args.allow_remote)
    except LinkEndpointError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    curve = None
    if options.curve_secret_key or options.curve_server_key:
        if not (options.curve_secret_key and options.curve_server_key):
            print(f"{PROG}: CURVE needs both --curve-secret-key and --curve-server-key", file=sys.stderr)
            return 2
        from kvserve.link.curve import load_keys

        curve = load_keys(options.curve_secret_key, [options.curve_server_key])
    link = config_from_args(LinkWorkerConfig, args, curve_keys=curve, parent_pid=parent_pid_from_env())
    try:
        parallel = config_from_args(TensorParallelConfig, args)
    except ValueError as exc:
        return _refused(exc)
    if options.executor == "fake":
        if parallel.tensor_parallel_size > 1:
            print(
                f"{PROG}: the fake executor has no model to shard; --tensor-parallel-size needs --executor torch",
                file=sys.stderr,
            )
            return 2
        try:
            return run_executor("fake", link, fake=fake_config_from_args(args))
        except ExecutorConfigError as exc:
            return _refused(exc)
    from kvserve.executor.process import run_tensor_parallel
    from kvserve.executor.tensor_parallel.config import TensorParallelSetupError
    from kvserve.executor.tensor_parallel.layout import TensorParallelFitError

    try:
        runner = runner_config_from_args(args)
        if parallel.tensor_parallel_size == 1:
            return run_executor("torch", link, runner=runner)
        return run_tensor_parallel(link, runner, parallel, link.parent_pid)
    except (ExecutorConfigError, TensorParallelFitError, TensorParallelSetupError) as exc:
        return _refused(exc)


def _refused(exc: Exception) -> int:
    """A configuration this executor refuses: one line, no traceback, the exit code the scheduler reads."""
    print(f"{PROG}: {exc}", file=sys.stderr)
    return int(ExitReason.REFUSED)


def parent_pid_from_env() -> int | None:
    """The supervisor's pid, taken out of the environment so that our own children do not inherit it."""
    value = os.environ.pop(defaults.EXECUTOR_PARENT_PID_ENV, "")
    return int(value) if value.isdigit() else None


def runner_config_from_args(args: argparse.Namespace) -> RunnerConfig:
    return config_from_args(RunnerConfig, args)


def fake_config_from_args(args: argparse.Namespace) -> FakeExecutorConfig:
    from kvserve.executor.weights.model_store import ensure_model_dir

    tokenizer_path = args.tokenizer_path or str(ensure_model_dir(args.model))
    return config_from_args(FakeExecutorConfig, args, tokenizer_path=tokenizer_path)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: the process's) and serve until the scheduler lets go."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
