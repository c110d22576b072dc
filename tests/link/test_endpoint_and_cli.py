"""Link endpoints default to private/loopback, and `kvserve executor` exposes every knob."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvserve.executor import entry as executor_command
from kvserve.executor.runner_config import RunnerConfig
from kvserve.link.endpoint import LinkEndpointError, check_endpoint, private_ipc_endpoint
from kvserve.scheduler.server.executor_link.connection import ExecutorLink

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "endpoint",
    [
        "ipc:///tmp/x.sock",
        "tcp://127.0.0.1:5555",
        "tcp://localhost:1",
        "tcp://[::1]:5555",
        "tcp://127.0.0.9:80",
    ],
)
def test_local_endpoints_are_accepted(endpoint: str) -> None:
    check_endpoint(endpoint)


@pytest.mark.parametrize(
    "endpoint", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "tcp://executor:5555"]
)
def test_remote_tcp_needs_explicit_opt_in(endpoint: str) -> None:
    with pytest.raises(LinkEndpointError, match="allow-remote-link"):
        check_endpoint(endpoint)
    with pytest.raises(LinkEndpointError):
        ExecutorLink(endpoint)
    check_endpoint(endpoint, allow_remote=True)
    ExecutorLink(endpoint, allow_remote=True)


@pytest.mark.parametrize("endpoint", ["udp://1.2.3.4:5", "127.0.0.1:5555", "tcp://127.0.0.1", "ipc://"])
def test_malformed_endpoints_are_refused(endpoint: str) -> None:
    with pytest.raises(LinkEndpointError):
        check_endpoint(endpoint, allow_remote=True)


def test_private_ipc_endpoint_is_in_a_0700_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    # A short runtime directory of the test's own: pytest's tmp_path (longer still under pytest-xdist)
    # can pass the 107 bytes a unix socket's path may have, which the endpoint rightly refuses.
    runtime = Path(tempfile.mkdtemp(prefix="xdg-"))
    try:
        for runtime_dir in (str(runtime), ""):
            monkeypatch.setenv("XDG_RUNTIME_DIR", runtime_dir)
            endpoint = private_ipc_endpoint()
            assert endpoint.startswith("ipc://") and endpoint.endswith(".sock")
            directory = Path(endpoint.removeprefix("ipc://")).parent
            assert stat.S_IMODE(directory.stat().st_mode) == 0o700
            assert directory.stat().st_uid == os.getuid()
            if runtime_dir:
                assert directory.parent == runtime
            assert endpoint != private_ipc_endpoint()  # every call gets its own directory
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def _executor_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    executor_command.add_arguments(parser)
    return parser


def test_every_runner_config_field_is_a_flag_with_its_default() -> None:
    args = _executor_parser().parse_args([])
    config = executor_command.runner_config_from_args(args)
    for field in dataclasses.fields(RunnerConfig):
        expected = field.default if field.name != "model" else "smollm2-135m-instruct"
        assert getattr(config, field.name) == expected, field.name
    args = _executor_parser().parse_args(
        ["--kv-cache-gb", "0.5", "--device", "cpu", "--max-model-len", "512", "--num-threads", "2"]
    )
    config = executor_command.runner_config_from_args(args)
    assert (config.kv_cache_gb, config.device, config.max_model_len, config.num_threads) == (0.5, "cpu", 512, 2)


def test_fake_flags_reach_the_fake_config(default_model_dir: Path) -> None:
    args = _executor_parser().parse_args(
        [
            "--executor",
            "fake",
            "--num-blocks",
            "99",
            "--block-size",
            "8",
            "--num-cpu-blocks",
            "7",
            "--step-latency-ms",
            "3.5",
            "--eos-probability",
            "0.25",
            "--max-model-len",
            "300",
        ]
    )
    fake = executor_command.fake_config_from_args(args)
    assert (
        fake.num_blocks,
        fake.block_size,
        fake.num_cpu_blocks,
        fake.step_latency_ms,
        fake.eos_probability,
        fake.max_model_len,
    ) == (99, 8, 7, 3.5, 0.25, 300)
    assert Path(fake.tokenizer_path) == default_model_dir


def test_help_shows_defaults() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve", "executor", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for expected in (
        "--executor {torch,fake}",
        "(default: torch)",
        "--link ENDPOINT",
        "--step-latency-ms",
        "--scheduler-timeout-s",
        "(default: 5.0)",
        "--kv-cache-gb",
        "--curve-secret-key",
    ):
        assert expected in text, expected


def test_remote_link_is_refused_without_the_flag(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve", "executor", "--executor", "fake", "--link", "tcp://10.0.0.1:5555"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "allow-remote-link" in proc.stderr
