"""docker-compose.yml run, not just parsed: each service's own command, environment and healthcheck.

tests/clients/compose_services.py turns the services into local processes (hostnames to
127.0.0.1, every listening port to one free port wherever it appears, /cache to a temporary
folder holding the converted model, the executor on the CPU or fake). The run needs every
healthcheck from the file to exit 0, readiness as the file documents it, a gRPC and an HTTP
answer through the published ports, and each service gone with exit 0 within its
stop_grace_period of SIGTERM. The Dockerfile's default CMD is started the same way, and the
checker is shown to fail on broken copies of the file.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.clients import Client
from kvserve.link.endpoint import is_loopback_host
from kvserve.testing.ports import free_ports
from tests.clients.compose_services import (
    LOOPBACK,
    ROOT,
    ComposeError,
    Running,
    check_compose,
    dockerfile_cmd,
    kill_all,
    kvserve_args,
    listens,
    load_compose,
    localize,
    published_address,
    start,
    start_healthy,
    stop,
    wait_healthy,
    wait_ready,
)


@pytest.fixture
def compose_up(scratch: Path) -> Iterator:
    """`up(executor)`: the localized services started in order, each healthy before its dependents start."""
    started: list[Running] = []

    def up(executor: str) -> tuple[dict[str, Running], dict[int, int]]:
        compose = load_compose()
        assert check_compose(compose) == []
        services, port_map = localize(compose, scratch, executor=executor)
        return start_healthy(services, scratch, started), port_map

    yield up
    kill_all(started)


@pytest.mark.parametrize("executor", ["fake", pytest.param("cpu", marks=pytest.mark.slow)])
def test_compose_services_come_up_answer_and_stop(compose_up, executor: str) -> None:
    running, port_map = compose_up(executor)
    scheduler = running["scheduler"]
    bound = {role: port_map[port] for role, port in listens(load_compose()["services"]["scheduler"]["command"]).items()}
    grpc_host, grpc_port = published_address(scheduler, bound["grpc"])
    http_host, http_port = published_address(scheduler, bound["http"])
    grpc_target, http_url = f"{grpc_host}:{grpc_port}", f"http://{http_host}:{http_port}"
    wait_ready(grpc_target, http_url)
    # Tokyo, not Paris: the default's Q4_1 x Q8 arithmetic (llama.cpp's) answers France with
    # "L'Étoile, la Marseillaise...", as llama-server does on the same GGUF.
    chat = [{"role": "user", "content": "What is the capital of Japan?"}]
    with Client(grpc_target, timeout_s=120) as client:
        completion = client.generate(messages=chat, max_tokens=8, temperature=0)
    assert 0 < completion.usage.completion_tokens <= 8 and completion.finish_reason in ("length", "eos", "stop")
    request = {"messages": chat, "max_tokens": 8, "temperature": 0}
    reply = httpx.post(f"{http_url}/v1/chat/completions", json=request, timeout=120)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] in ("length", "stop") and choice["message"]["role"] == "assistant"
    if executor == "cpu":  # the real model, greedy: both APIs give the same answer
        assert "Tokyo" in completion.text and choice["message"]["content"] == completion.text
    for name in reversed(list(running)):  # in start order; compose stops dependents first
        stop(running[name])


def test_dockerfile_default_cmd_starts_on_loopback(scratch: Path) -> None:
    """The image's CMD passes the bind policy and serves (ports moved to free ones, the fake executor)."""
    cmd = dockerfile_cmd()
    args = kvserve_args(cmd)
    assert args.command == "serve" and is_loopback_host(args.host) and is_loopback_host(args.http_host or args.host)
    grpc_port, http_port = free_ports(2)
    moved = ["--port", str(grpc_port), "--http-port", str(http_port), "--executor", "fake"]
    service = {
        "command": [sys.executable, "-m", *cmd, *moved],
        "environment": {"KVSERVE_CACHE": str(scratch / "model-cache")},
        "stop_grace_period": "40s",
    }
    running = start("image", service, scratch)
    try:
        with Client(f"{LOOPBACK}:{grpc_port}", timeout_s=30) as client:
            client.wait_until_serving(120)
        assert httpx.get(f"http://{LOOPBACK}:{http_port}/ready", timeout=30).status_code == 200
        stop(running)
    finally:
        kill_all([running])


# --- the checker fails on what it should -------------------------------------------------------


def test_the_compose_file_hangs_together() -> None:
    assert check_compose(load_compose()) == []


def _broken(edit) -> list[str]:
    compose = load_compose()
    edit(compose["services"])
    return check_compose(compose)


def _replace(command: list[str], old: str, new: str) -> None:
    command[command.index(old)] = new


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda s: _replace(s["executor"]["command"], "tcp://scheduler:50052", "tcp://scheduler:50053"), "--link port"),
        (
            lambda s: _replace(s["executor"]["command"], "tcp://scheduler:50052", "tcp://sched:50052"),
            "names no service",
        ),
        (lambda s: s["scheduler"]["ports"].append("127.0.0.1:8001:8001"), "publishes target 8001"),
        (lambda s: _replace(s["scheduler"]["command"], "8000", "8080"), "publishes target 8000"),
        (lambda s: _replace(s["scheduler"]["healthcheck"]["test"], "50051", "50061"), "probes port 50061"),
        (lambda s: _replace(s["executor"]["healthcheck"]["test"], "50052", "50051"), "probes port 50051"),
        (lambda s: s["scheduler"]["command"].remove("--allow-insecure-remote"), "would exit: refusing"),
        (lambda s: s["scheduler"]["ports"].append("8000:8000"), "published on 0.0.0.0"),
        (lambda s: s["executor"].pop("depends_on"), "does not depend_on"),
    ],
)
def test_the_checker_catches_a_broken_copy(edit, expected: str) -> None:
    problems = _broken(edit)
    assert any(expected in p for p in problems), problems


def test_a_failing_healthcheck_fails_the_run(tmp_path: Path) -> None:
    """wait_healthy gives up on a check that never exits 0 (and says which), and on a service that died."""
    failing = ["CMD", sys.executable, "-c", "raise SystemExit(1)"]
    sleeper = {
        "command": [sys.executable, "-c", "import time; time.sleep(60)"],
        "environment": {},
        "healthcheck": {"test": failing, "interval": "1s", "timeout": "1s", "retries": 1, "start_period": "0s"},
    }
    running = start("sleeper", sleeper, tmp_path)
    try:
        with pytest.raises(ComposeError, match="never passed"):
            wait_healthy(running)
    finally:
        kill_all([running])
    dead = {**sleeper, "command": [sys.executable, "-c", "raise SystemExit(2)"]}
    running = start("dead", dead, tmp_path)
    running.process.wait(30)
    with pytest.raises(ComposeError, match="exited with 2"):
        wait_healthy(running)


def test_localize_maps_each_port_the_same_everywhere(tmp_path: Path) -> None:
    compose = load_compose()
    services, port_map = localize(compose, tmp_path, executor="fake")
    scheduler, executor = services["scheduler"], services["executor"]
    link = port_map[listens(compose["services"]["scheduler"]["command"])["link"]]
    assert f"tcp://{LOOPBACK}:{link}" in executor["command"] and executor["healthcheck"]["test"][-1] == str(link)
    assert f"tcp://0.0.0.0:{link}" in scheduler["command"]
    grpc = scheduler["command"][scheduler["command"].index("--port") + 1]
    assert scheduler["healthcheck"]["test"][scheduler["healthcheck"]["test"].index("--port") + 1] == grpc
    assert {p.target for p in scheduler["ports"]} == {int(grpc), port_map[8000]}
    assert set(port_map) == {50051, 8000, 50052} and len(set(port_map.values())) == 3
    assert str(ROOT / "docker" / "link_healthcheck.py") in executor["healthcheck"]["test"]
    assert scheduler["environment"]["KVSERVE_CACHE"] == str(tmp_path / "model-cache")
