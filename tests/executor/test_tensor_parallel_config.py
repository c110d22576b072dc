"""The tensor-parallel flags, a rank's place from the environment, and what each rank derives from them."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.executor import entry
from kvserve.executor.runner_config import RunnerConfig, resolve_device, resolve_num_threads
from kvserve.executor.tensor_parallel.config import (
    SPAWNED_ENV,
    RankPlace,
    TensorParallelConfig,
    place_from_env,
    resolve_backend,
)
from kvserve.executor.tensor_parallel.launcher import follower_argv

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_ranks_command_line_rebuilds_rank_zeros_configs() -> None:
    """Ranks 1 … N−1 get rank 0's configs through their command line (`config_to_argv`), every field."""
    runner = RunnerConfig(
        model="/models/m", device="cpu", dtype="bfloat16", kv_cache_gb=0.25, max_model_len=640, num_threads=3,
        block_size=32, swap_space_gb=1.5, max_num_seqs=17, attention_backend="torch", weights="dequantized",
    )  # fmt: skip
    parallel = TensorParallelConfig(tensor_parallel_size=3, tp_backend="gloo", tp_timeout_s=7.5)
    args = entry.build_parser().parse_args(follower_argv(runner, parallel))
    assert entry.runner_config_from_args(args) == runner
    assert entry.config_from_args(TensorParallelConfig, args) == parallel
    assert args.executor == "torch"


def test_defaults_are_left_off_the_ranks_command_line() -> None:
    argv = follower_argv(RunnerConfig(), TensorParallelConfig(tensor_parallel_size=2))
    assert argv == ["--executor", "torch", "--tensor-parallel-size", "2"]


@pytest.mark.parametrize("spelling", [["-tp", "3"], ["--tensor-parallel-size", "3"]])
def test_tp_is_short_for_tensor_parallel_size_on_executor_and_serve(spelling) -> None:
    from kvserve.cli import build_parser

    assert entry.build_parser().parse_args(spelling).tensor_parallel_size == 3
    assert build_parser().parse_args(["serve", *spelling]).tensor_parallel_size == 3


def test_serve_passes_the_size_to_its_executor() -> None:
    from kvserve.cli import build_parser
    from kvserve.commands.serve import child_executor_from_args, executor_args
    from kvserve.config.flags import config_from_args
    from kvserve.scheduler.server.server_config import ServerConfig

    def child_argv(*flags: str) -> list[str]:
        args = build_parser().parse_args(["serve", *flags])
        return executor_args(child_executor_from_args(args), config_from_args(ServerConfig, args), "ipc:///x")

    argv = child_argv("-tp", "2", "--tp-backend", "gloo")
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and argv[argv.index("--tp-backend") + 1] == "gloo"
    assert "--tensor-parallel-size" not in child_argv()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["-tp", "0"], "--tensor-parallel-size must be at least 1, got 0"),
        (["-tp", "2", "--tp-timeout-s", "0"], "--tp-timeout-s must be positive"),
        (["--executor", "fake", "-tp", "2"], "the fake executor has no model to shard"),
        (["-tp", "2", "--device", "cuda:1"], "--device cuda:1 with --tensor-parallel-size: use --device cuda"),
        (["-tp", "2", "ENV:RANK=x", "ENV:WORLD_SIZE=2"], "RANK='x' in the environment is not an integer"),
        (["-tp", "2", "ENV:RANK=0", "ENV:WORLD_SIZE=2"], "RANK and WORLD_SIZE are set but MASTER_ADDR is not"),
    ],
)
def test_bad_sizes_and_places_exit_2_naming_the_flag(argv: list[str], message: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(arg.removeprefix("ENV:").split("=", 1) for arg in argv if arg.startswith("ENV:"))
    flags = [arg for arg in argv if not arg.startswith("ENV:")]
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve", "executor", "--link", "ipc:///tmp/kvserve-tp-never.sock", *flags],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_shows_the_tensor_parallel_flags() -> None:
    parser = entry.build_parser()
    text = " ".join(parser.format_help().split())
    for expected in (
        "--tensor-parallel-size N, -tp N",
        "--tp-backend {auto,gloo,nccl}",
        "--tp-timeout-s",
        "MASTER_ADDR",
    ):
        assert expected in text, expected


def test_a_place_comes_from_the_torchrun_environment() -> None:
    assert place_from_env(2, {}) is None  # rank 0 of a group it starts itself
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    place = place_from_env(4, env)
    assert place == RankPlace(1, 4, 0, 4, "10.0.0.1", 29500, launched_by_leader=False)
    assert not place.is_leader
    assert place_from_env(4, {**env, SPAWNED_ENV: "1", "LOCAL_WORLD_SIZE": "2"}) == dataclasses.replace(
        place, local_world_size=2, launched_by_leader=True
    )
    with pytest.raises(ValueError, match="WORLD_SIZE=4 in the environment, but --tensor-parallel-size 2"):
        place_from_env(2, env)
    with pytest.raises(ValueError, match="MASTER_PORT is not"):
        place_from_env(4, {k: v for k, v in env.items() if k != "MASTER_PORT"})
    with pytest.raises(ValueError, match="RANK=4 is outside WORLD_SIZE=4"):
        place_from_env(4, {**env, "RANK": "4"})


def test_each_rank_takes_its_gpu_its_backend_and_its_share_of_the_cores() -> None:
    assert resolve_device(RunnerConfig(device="cuda"), local_rank=1) == "cuda:1"
    assert resolve_device(RunnerConfig(device="cpu"), local_rank=1) == "cpu"
    assert resolve_backend(TensorParallelConfig(), "cuda:1") == "nccl"
    assert resolve_backend(TensorParallelConfig(), "cpu") == "gloo"
    assert resolve_backend(TensorParallelConfig(tp_backend="gloo"), "cuda:0") == "gloo"
    alone = resolve_num_threads(RunnerConfig())
    assert resolve_num_threads(RunnerConfig(), ranks_on_host=2) == max(1, alone // 2)
    assert resolve_num_threads(RunnerConfig(num_threads=3), ranks_on_host=2) == 3


@pytest.mark.parametrize("cores,ranks,threads", [(1, 1, 1), (2, 1, 1), (3, 1, 2), (8, 1, 7), (8, 2, 3), (2, 2, 1)])
def test_the_default_leaves_one_core_to_the_scheduler(monkeypatch, cores, ranks, threads) -> None:
    """Where torch's OpenMP GEMMs run the step, the scheduler process keeps a core wherever there are
    two (docs/benchmarks.md, "Threads that coexist")."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert resolve_num_threads(RunnerConfig(), ranks_on_host=ranks) == threads


@pytest.mark.parametrize("cores,threads", [(1, 1), (2, 2), (8, 8)])
def test_the_native_path_takes_every_core_by_default(monkeypatch, cores, threads) -> None:
    """Its kernels' loops never wait for a thread without work (kernels/cpu/work_pool.h); asked-for counts stand."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert resolve_num_threads(RunnerConfig(), weights="native") == threads
    assert resolve_num_threads(RunnerConfig(num_threads=1), weights="native") == 1


def test_an_unknown_backend_is_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        entry.build_parser().parse_args(["--tp-backend", "mpi"])


def test_a_failure_inside_a_sharded_forward_ends_the_group_not_the_step() -> None:
    """Another rank may be waiting in a collective this one never reaches: the step cannot just fail."""
    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.tensor_parallel.group import RankLostError

    class _Broken:
        def forward(self, *_):
            raise MemoryError("out of memory")

    class _Group:
        rank = 1

    runner = object.__new__(ModelRunner)
    runner.model, runner.cache, runner.backend = _Broken(), None, None
    runner.group, runner.graphs = None, None
    with pytest.raises(MemoryError):
        runner._forward(None)  # alone: an ordinary step error
    runner.group = _Group()
    with pytest.raises(RankLostError, match="the forward pass failed on rank 1"):
        runner._forward(None)
