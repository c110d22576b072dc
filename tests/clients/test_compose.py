"""docker-compose.yml and docker/Dockerfile, checked by parsing (no Docker engine on these machines).

test_compose_services.py runs the services; `docker-compose config` validates the file where installed.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from protos import defaults
from tests.clients.compose_services import dockerfile_cmd, kvserve_args, published_ports

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
LINK_HEALTHCHECK = ROOT / "docker" / "link_healthcheck.py"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def option(command: list[str], flag: str) -> str:
    assert flag in command, f"{flag} missing from {command}"
    return command[command.index(flag) + 1]


def test_two_services_from_one_image(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"scheduler", "executor"}
    assert services["scheduler"]["image"] == services["executor"]["image"]
    assert services["executor"]["build"]["dockerfile"] == "docker/Dockerfile"
    assert services["scheduler"]["command"][:2] == ["kvserve", "scheduler"]
    assert services["executor"]["command"][:2] == ["kvserve", "executor"]


def test_executor_reserves_an_nvidia_gpu(compose: dict) -> None:
    devices = compose["services"]["executor"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
    assert option(compose["services"]["executor"]["command"], "--executor") == "torch"
    assert "deploy" not in compose["services"]["scheduler"]  # the scheduler is CPU-only


def test_scheduler_publishes_both_apis_on_host_loopback(compose: dict) -> None:
    scheduler = compose["services"]["scheduler"]
    grpc_port, http_port = int(option(scheduler["command"], "--port")), int(option(scheduler["command"], "--http-port"))
    assert (grpc_port, http_port) == (defaults.GRPC_PORT, defaults.HTTP_PORT)
    assert option(scheduler["command"], "--host") == "0.0.0.0"  # reachable from outside its container
    assert "--http-host" not in scheduler["command"]  # HTTP listens where gRPC does
    published = {p.target: p for p in published_ports(scheduler)}
    assert set(published) == {grpc_port, http_port}
    for port in published.values():
        assert port.host_ip == "127.0.0.1" and port.published == port.target
    assert "ports" not in compose["services"]["executor"]  # the link stays on the compose network


def test_unauthenticated_apis_are_allowed_only_because_published_on_loopback(compose: dict) -> None:
    """The secure default: no token, so --allow-insecure-remote, said to be safe next to it in the file."""
    scheduler = compose["services"]["scheduler"]
    assert "--allow-insecure-remote" in scheduler["command"] and "--auth-token-file" not in scheduler["command"]
    text = COMPOSE.read_text()
    assert "published on the host's 127.0.0.1 only" in text and "--auth-token-file" in text
    assert "tensor parallelism" in text  # the two-GPU layout: said not to exist yet, nothing fake


def test_link_endpoints_are_consistent(compose: dict) -> None:
    services = compose["services"]
    bind = option(services["scheduler"]["command"], "--link")
    connect = option(services["executor"]["command"], "--link")
    bind_host, bind_port = re.fullmatch(r"tcp://([^:]+):(\d+)", bind).groups()
    connect_host, connect_port = re.fullmatch(r"tcp://([^:]+):(\d+)", connect).groups()
    assert bind_host == "0.0.0.0" and connect_host == "scheduler" and connect_host in services
    assert bind_port == connect_port == str(defaults.LINK_TCP_PORT)
    for name in ("scheduler", "executor"):
        assert "--allow-remote-link" in services[name]["command"]  # tcp off loopback is opt-in
    assert set(services["scheduler"]["networks"]) & set(services["executor"]["networks"])


def test_healthchecks_and_startup_order(compose: dict) -> None:
    services = compose["services"]
    scheduler_check = services["scheduler"]["healthcheck"]["test"]
    assert scheduler_check[0] == "CMD" and scheduler_check[1:4] == ["kvserve", "stats", "--alive"]  # liveness
    assert int(option(scheduler_check, "--port")) == defaults.GRPC_PORT
    executor_check = services["executor"]["healthcheck"]["test"]
    assert executor_check[-2].endswith("link_healthcheck.py")
    assert executor_check[-1] == str(defaults.LINK_TCP_PORT)
    assert services["executor"]["depends_on"]["scheduler"]["condition"] == "service_healthy"


def test_model_cache_volume_is_shared(compose: dict) -> None:
    assert "model-cache" in compose["volumes"]
    for name in ("scheduler", "executor"):
        service = compose["services"][name]
        mounts = dict(v.split(":", 1) for v in service["volumes"])
        assert mounts["model-cache"] == service["environment"][defaults.CACHE_DIR_ENV]


def test_compose_commands_parse_with_the_cli(compose: dict) -> None:
    """The flags compose passes exist in `kvserve` (fails if a command renames an option)."""
    from kvserve.cli import build_parser

    parser = build_parser()
    for name in ("scheduler", "executor"):
        parser.parse_args(compose["services"][name]["command"][1:])
    parser.parse_args(compose["services"]["scheduler"]["healthcheck"]["test"][2:])


def test_dockerfile_builds_one_cuda_image() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG TORCH_VERSION=\d+\.\d+\.\d+$", text, re.M)  # torch is pinned
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cu\d+$", text, re.M)
    assert "ENV" in text and f"{defaults.CACHE_DIR_ENV}=/cache" in text
    assert "COPY docker/link_healthcheck.py ./docker/link_healthcheck.py" in text
    assert "WORKDIR /app" in text
    for package in ("kvserve", "protos", "scheduler_svc", "executor_svc", "kernels", "clients"):
        assert f"COPY {package} ./{package}" in text


def test_dockerfile_default_cmd_serves_on_loopback_and_exposes_its_ports() -> None:
    """`docker run -p 50051:50051 kvserve` must not expose an unauthenticated API: the CMD keeps loopback."""
    args = kvserve_args(dockerfile_cmd())
    assert args.command == "serve" and args.host == "127.0.0.1" and args.http_host is None
    assert not args.allow_insecure_remote
    (expose,) = re.findall(r"^EXPOSE (.+)$", DOCKERFILE.read_text(), re.M)
    assert {args.port, args.http_port, defaults.LINK_TCP_PORT} <= {int(p) for p in expose.split()}
    assert "--auth-token-file" in DOCKERFILE.read_text()  # the comment says how to expose it further


def _compose_tools() -> list[list[str]]:
    tools = [["docker-compose"]] if shutil.which("docker-compose") else []
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        tools.append(["docker", "compose"])
    return tools


COMPOSE_TOOLS = _compose_tools()


@pytest.mark.skipif(not COMPOSE_TOOLS, reason="neither docker-compose nor `docker compose` is installed")
@pytest.mark.parametrize("tool", COMPOSE_TOOLS or [["docker-compose"]], ids=" ".join)
def test_docker_compose_config_accepts_the_file(tool: list[str], tmp_path: Path) -> None:
    """The tool's own schema check (no engine needed); Debian's docker-compose 1.29 is the strictest."""
    result = subprocess.run(
        [*tool, "--project-directory", str(ROOT), "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert set(resolved["services"]) == {"scheduler", "executor"}
    assert all(p.host_ip == "127.0.0.1" for p in published_ports(resolved["services"]["scheduler"]))


def _run_link_healthcheck(port: int) -> int:
    return subprocess.run([sys.executable, str(LINK_HEALTHCHECK), str(port)], timeout=30).returncode


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_link_healthcheck_sees_an_established_connection() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert _run_link_healthcheck(port) == 1  # listening only: not linked yet
        with socket.create_connection(("127.0.0.1", port)):
            peer, _ = server.accept()
            with peer:
                assert _run_link_healthcheck(port) == 0
