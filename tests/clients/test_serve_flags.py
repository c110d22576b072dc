"""`kvserve serve` takes the executor's flags directly (one command line, as `vllm serve`), each
generated from the executor's own config and handed to its child; its scheduling flags are the
scheduler core's `SchedulerConfig` fields; its --help is in sections."""

from __future__ import annotations

import argparse
import re

import pytest

from kvserve.cli import build_parser
from kvserve.clients import Client
from kvserve.commands.serve import SET_BY_SERVE, ServeConfig, child_executor_from_args, executor_args, serve_argv
from kvserve.config import defaults
from kvserve.config.flags import config_from_args, config_to_argv
from kvserve.executor import entry
from kvserve.scheduler.core import SchedulerConfig
from kvserve.scheduler.server.server_config import HANDSHAKE_FIELDS, ServerConfig
from tests.clients.test_cli_commands import run_cli

SECTIONS = [
    "executor",
    "model runner (--executor torch)",
    "fake executor (--executor fake)",
    "tensor parallelism",
    "data parallel (replicas behind vllm-router)",
    "scheduler",
    "admission and shutdown",
    "gRPC API",
    "OpenAI-compatible HTTP API",
    "API security",
    "observability (metrics, KV events)",
    "executor link",
]


def _subparser(name: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


def _by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest != "help"}


def _serve(*flags: str) -> tuple[list[str], ServerConfig]:
    """The supervised executor's argv for `kvserve serve FLAGS` (as serve builds it), and the scheduler's config."""
    args = build_parser().parse_args(["serve", *flags])
    server = config_from_args(ServerConfig, args)
    return executor_args(child_executor_from_args(args), server, "ipc:///tmp/kvserve-flags.sock"), server


def test_serve_hands_the_executor_flags_to_its_child_and_keeps_the_schedulers() -> None:
    argv, server = _serve(
        *("--dtype", "float32", "--weights", "native", "--speculative", "ngram", "--kv-cache-dtype", "bfloat16"),
        *("--num-threads", "3", "--attention-backend", "cpu", "--compile", "on", "--device", "cpu"),
        *("--no-batch-invariant", "--swap-space-gb", "0.5", "-tp", "2", "--tp-backend", "gloo"),
        *("--copy-period", "6", "--model-id", "m", "--scheduler-timeout-s", "9"),
        *("--executor-curve-secret-key", "exec.key_secret", "--executor-curve-server-key", "sched.key"),
        *("--curve-secret-key", "sched.key_secret", "--max-num-seqs", "7", "--max-model-len", "300"),
        *("--heartbeat-interval-s", "0.25", "--allow-remote-link"),
    )
    child = entry.build_parser().parse_args(argv)  # the executor's own parser takes every one of them
    runner = entry.runner_config_from_args(child)
    assert (runner.dtype, runner.weights, runner.kv_cache_dtype, runner.attention_backend) == (
        "float32",
        "native",
        "bfloat16",
        "cpu",
    )
    assert (runner.num_threads, runner.compile, runner.device, runner.batch_invariant, runner.swap_space_gb) == (
        3,
        "on",
        "cpu",
        False,
        0.5,
    )
    assert (child.tensor_parallel_size, child.tp_backend, child.copy_period, child.model_id) == (2, "gloo", 6, "m")
    assert (child.curve_secret_key, child.curve_server_key) == ("exec.key_secret", "sched.key"), "the child's own"
    # what serve sets itself: the link it binds and the scheduler's period, remote flag and budgets
    assert (child.endpoint, child.heartbeat_interval_s, child.allow_remote, child.scheduler_timeout_s) == (
        "ipc:///tmp/kvserve-flags.sock",
        0.25,
        True,
        9.0,
    )
    assert (runner.max_num_seqs, runner.max_model_len) == (7, 300)
    assert not child.reregister
    # the scheduling flags stay with the scheduler
    assert "--speculative" not in argv and server.scheduling.speculative == "ngram"
    assert server.scheduling.max_num_seqs == 7 and server.curve_secret_key == "sched.key_secret"


def test_defaults_stay_off_the_childs_command_line() -> None:
    argv, _ = _serve()
    assert argv == ["--link", "ipc:///tmp/kvserve-flags.sock", "--model", defaults.DEFAULT_MODEL]


def test_a_replica_gets_the_same_serve_command_line_back() -> None:
    flags = ["--executor", "fake", "--num-blocks", "99", "--copy-period", "6", "--executor-curve-secret-key", "e.key"]
    flags += ["--no-executor-restart", "--dtype", "float32", "--connect-timeout-s", "7"]
    args = build_parser().parse_args(["serve", *flags])
    child = child_executor_from_args(args)
    again = build_parser().parse_args(["serve", *serve_argv(config_from_args(ServeConfig, args), child)])
    assert child_executor_from_args(again) == child
    assert not config_from_args(ServeConfig, again).executor_restart


def test_every_executor_flag_has_its_help_default_and_choices_on_serve() -> None:
    executor, serve = _by_dest(entry.build_parser()), _by_dest(_subparser("serve"))
    renamed = {"curve_secret_key", "curve_server_key"}
    for dest, action in executor.items():
        if dest in SET_BY_SERVE or dest == "endpoint":
            continue  # serve's child gets them from serve (those of the same name on serve are the scheduler's)
        mine = serve[f"executor_{dest}" if dest in renamed else dest]
        assert (mine.help, mine.default, mine.choices, mine.type, mine.nargs, mine.metavar) == (
            action.help,
            action.default,
            action.choices,
            action.type,
            action.nargs,
            action.metavar,
        ), dest
        expected = [s.replace("--", "--executor-") for s in action.option_strings] if dest in renamed else None
        assert mine.option_strings == (expected or action.option_strings), dest
    for dest in ("allow_remote", "reregister", "endpoint"):
        assert dest not in serve, f"serve sets {dest} for its child itself"


def _help_entries(text: str) -> dict[str, str]:
    """Each option's whole --help entry (flag, metavar, help, default), by its first option string."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if re.match(r"^  -", line):
            current = line.split()[0].rstrip(",")
            entries[current] = line.strip()
        elif current is not None and line.startswith("   "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def test_serve_help_shows_an_executor_flag_as_kvserve_executor_does() -> None:
    serve, executor = run_cli("serve", "--help"), run_cli("executor", "--help")
    assert serve.returncode == 0 and executor.returncode == 0, serve.stderr + executor.stderr
    on_serve, on_executor = _help_entries(serve.stdout), _help_entries(executor.stdout)
    for option in ("--dtype", "--weights", "--num-threads", "--num-blocks", "--tensor-parallel-size", "--copy-period"):
        assert on_serve[option] == on_executor[option], option
    assert "(default: auto)" in on_serve["--dtype"] and "{auto,float32,bfloat16,float16}" in on_serve["--dtype"]


def _sections(text: str) -> dict[str, str]:
    """Each --help section's text, by its title."""
    parts = re.split(r"^(\S[^\n]*):$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_serve_help_groups_its_flags_by_section() -> None:
    result = run_cli("serve", "--help")
    assert result.returncode == 0, result.stderr
    sections = _sections(result.stdout)
    assert [title for title in sections if title != "options"] == SECTIONS
    where = {
        "--executor ": "executor",
        "--dtype": "model runner (--executor torch)",
        "--copy-period": "fake executor (--executor fake)",
        "--tp-backend": "tensor parallelism",
        "--data-parallel-size": "data parallel (replicas behind vllm-router)",
        "--speculative ": "scheduler",
        "--max-num-seqs": "scheduler",
        "--drain-grace-s": "admission and shutdown",
        "--port": "gRPC API",
        "--http-port": "OpenAI-compatible HTTP API",
        "--auth-token-file": "API security",
        "--metrics-port": "observability (metrics, KV events)",
        "--kv-events-endpoint": "observability (metrics, KV events)",
        "--link": "executor link",
        "--executor-curve-secret-key": "executor link",
    }
    for option, title in where.items():
        assert option in sections[title], (option, title)
    assert "--executor-args" not in result.stdout


def test_the_scheduling_flags_are_schedulerconfigs_fields_on_serve_and_scheduler() -> None:
    policy = {f.name: f for f in SchedulerConfig.__dataclass_fields__.values() if f.name not in HANDSHAKE_FIELDS}
    policy_defaults = SchedulerConfig(num_blocks=1)
    for command in ("serve", "scheduler"):
        actions = _by_dest(_subparser(command))
        for name, f in policy.items():
            assert actions[name].help.replace("turn off: ", "") == f.metadata["help"].replace("%", "%%"), name
            assert actions[name].default == getattr(policy_defaults, name), name
        handshake = set(HANDSHAKE_FIELDS) - {"max_model_len"}  # (the server's own --max-model-len caps the executor's)
        if command == "serve":
            handshake -= {"num_blocks", "num_cpu_blocks", "block_size"}  # the executor's flags on serve
        assert not handshake & set(actions), command
    args = build_parser().parse_args(["scheduler", "--speculative", "ngram", "--no-prefix-caching", "--ngram-min", "1"])
    server = config_from_args(ServerConfig, args)
    assert (server.scheduling.speculative, server.scheduling.enable_prefix_caching, server.scheduling.ngram_min) == (
        "ngram",
        False,
        1,
    )
    # and a replica's command line carries them back
    again = build_parser().parse_args(["scheduler", *config_to_argv(server)])
    assert config_from_args(ServerConfig, again) == server


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64' (choose from 'auto', 'float32',"),
        (
            ["--weights", "int8"],
            "argument --weights: invalid choice: 'int8' (choose from 'auto', 'dequantized', 'native')",
        ),
        (["--num-threads", "many"], "argument --num-threads: invalid int value: 'many'"),
        (["--executor", "tpu"], "argument --executor: invalid choice: 'tpu' (choose from 'torch', 'fake')"),
        (["-tp", "0"], "kvserve serve: --tensor-parallel-size must be at least 1, got 0"),
        (
            ["--ngram-min", "5", "--ngram-max", "2"],
            "kvserve serve: SchedulerConfig.ngram_max (2) is below ngram_min (5)",
        ),
        (["--executor-args", "--dtype float32"], "unrecognized arguments: --executor-args"),
    ],
)
def test_a_bad_flag_value_is_refused_before_anything_starts(flags: list[str], message: str) -> None:
    result = run_cli("serve", "--port", "0", "--http-port", "0", *flags)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr and "executor_started" not in result.stderr


def test_the_scheduler_alone_refuses_a_bad_policy_the_same_way() -> None:
    result = run_cli("scheduler", "--port", "0", "--ngram-min", "5", "--ngram-max", "2")
    assert result.returncode == 2 and "kvserve scheduler: SchedulerConfig.ngram_max (2)" in result.stderr


@pytest.mark.timeout(180)
def test_serve_runs_the_fake_executor_with_executor_and_scheduler_flags(serve_factory) -> None:
    server = serve_factory(
        [
            *("--executor", "fake", "--model-id", "fake-from-serve-flags", "--num-blocks", "333"),
            *("--block-size", "32", "--copy-period", "6", "--step-latency-ms", "1"),
            *("--speculative", "ngram", "--ngram-min", "1", "--max-model-len", "512"),
        ]
    )
    with Client(server.address) as client:
        info = client.model_info()
        completion = client.generate("the quick brown fox jumps over", max_tokens=24, temperature=0)
    assert (info["model_id"], info["num_blocks"], info["block_size"], info["max_model_len"]) == (
        "fake-from-serve-flags",
        333,
        32,
        512,
    )
    assert completion.usage.speculative is not None and completion.usage.speculative.accepted_tokens > 0
