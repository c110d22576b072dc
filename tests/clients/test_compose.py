"""docker-compose.yml, its two-GPU override docker-compose.tp2.yml and docker/Dockerfile, checked by parsing
(no Docker engine on these machines).

test_compose_services.py runs the services; `docker-compose config` validates the files where installed.
The override is merged over the base file by `merge_compose`, which follows Compose v2's merge rules.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kvserve.config import defaults
from tests.clients.compose_services import dockerfile_cmd, kvserve_args, published_ports

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_TP2 = ROOT / "docker-compose.tp2.yml"
TP2_UP = "docker compose -f docker-compose.yml -f docker-compose.tp2.yml up -d --build"
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


# --- docker-compose.tp2.yml -------------------------------------------------------------------


@dataclass(frozen=True)
class Tagged:
    """A value under one of Compose v2's merge tags: `!override` (replaces the base value) or `!reset` (drops it)."""

    tag: str
    value: object


class ComposeLoader(yaml.SafeLoader):
    """yaml.safe_load plus `!override` and `!reset`, which a plain YAML loader refuses (as Compose v1 does)."""


def _construct_tagged(loader: ComposeLoader, node: yaml.Node) -> Tagged:
    if isinstance(node, yaml.SequenceNode):
        return Tagged(node.tag, loader.construct_sequence(node, deep=True))
    if isinstance(node, yaml.MappingNode):
        return Tagged(node.tag, loader.construct_mapping(node, deep=True))
    return Tagged(node.tag, loader.construct_scalar(node))


for _tag in ("!override", "!reset"):
    ComposeLoader.add_constructor(_tag, _construct_tagged)


def load_compose_file(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


_DROPPED = object()


def _plain(value: object) -> object:
    """An override's value where the base has none: its tags resolved."""
    if isinstance(value, Tagged):
        return _DROPPED if value.tag == "!reset" else _plain(value.value)
    if isinstance(value, dict):
        return {k: v for k, v in ((k, _plain(v)) for k, v in value.items()) if v is not _DROPPED}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _replaced_whole(path: tuple[str, ...]) -> bool:
    """The sequences Compose replaces instead of appending to: a service's command, entrypoint, healthcheck test."""
    return path[:1] == ("services",) and path[2:] in (("command",), ("entrypoint",), ("healthcheck", "test"))


def merge_compose(base: object, override: object, path: tuple[str, ...] = ()) -> object:
    """`docker compose -f BASE -f OVERRIDE` as Compose v2 merges them (compose-spec "Merge"): mappings key by
    key, scalars replaced, sequences appended (command, entrypoint and healthcheck.test replaced), `!override`
    replaces and `!reset` drops. (Compose also merges ports, volumes, secrets and configs by key; the override
    sets none of them, test_tp2_override_changes_only_the_executor checks.)"""
    if isinstance(override, Tagged):
        return _plain(override)
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            result = merge_compose(base[key], value, (*path, key)) if key in base else _plain(value)
            if result is _DROPPED:
                merged.pop(key, None)
            else:
                merged[key] = result
        return merged
    if isinstance(base, list) and isinstance(override, list) and not _replaced_whole(path):
        return [*base, *_plain(override)]
    return _plain(override)


@pytest.fixture(scope="module")
def tp2() -> dict:
    return load_compose_file(COMPOSE_TP2)


@pytest.fixture(scope="module")
def merged(compose: dict, tp2: dict) -> dict:
    return merge_compose(compose, tp2)


def nvidia_gpus(service: dict) -> list[int]:
    """The number of GPUs each NVIDIA device request of a service reserves."""
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    found = []
    for device in devices:
        if device.get("driver") != "nvidia":
            continue
        assert "gpu" in device.get("capabilities", []), device
        assert ("count" in device) != ("device_ids" in device), f"count or device_ids, one of them: {device}"
        found.append(int(device["count"]) if "count" in device else len(set(device["device_ids"])))
    return found


_SIZE = re.compile(r"(\d+)([bkmg]?)b?", re.I)


def size_bytes(value: str | int) -> int:
    """A compose byte size ("2gb", "512m", 1073741824) in bytes."""
    if isinstance(value, int):
        return value
    match = _SIZE.fullmatch(value.strip())
    assert match, f"unreadable size {value!r}"
    return int(match[1]) * 1024 ** "bkmg".index((match[2] or "b").lower())


def test_base_file_points_to_the_tp2_override() -> None:
    text = COMPOSE.read_text()
    assert "no tensor parallelism" not in text
    assert "docker-compose.tp2.yml" in text and TP2_UP in text
    assert TP2_UP in COMPOSE_TP2.read_text()  # the override's own header says the same


def test_tp2_override_changes_only_the_executor(compose: dict, tp2: dict, merged: dict) -> None:
    assert set(tp2) == {"services"} and set(tp2["services"]) == {"executor"}
    assert set(tp2["services"]["executor"]) == {"command", "deploy", "shm_size"}
    assert merged["services"]["scheduler"] == compose["services"]["scheduler"]
    assert {k: v for k, v in merged.items() if k != "services"} == {k: v for k, v in compose.items() if k != "services"}
    base, executor = compose["services"]["executor"], merged["services"]["executor"]
    assert {k: v for k, v in executor.items() if k not in tp2["services"]["executor"]} == {
        k: v for k, v in base.items() if k not in tp2["services"]["executor"]
    }  # image, volumes, networks, restart, depends_on, healthcheck, stop_grace_period: the base file's
    assert {k: v for k, v in executor["deploy"].items() if k != "resources"} == {
        k: v for k, v in base["deploy"].items() if k != "resources"
    }


def test_tp2_executor_command_is_the_base_one_plus_the_tp_size(compose: dict, merged: dict) -> None:
    from kvserve.executor.entry import build_parser

    base = compose["services"]["executor"]["command"]
    command = merged["services"]["executor"]["command"]
    assert command[:2] == ["kvserve", "executor"]
    assert command[: len(base)] == base  # the whole base command repeated: an override's command replaces it
    assert command[len(base) :] in (["--tensor-parallel-size", "2"], ["-tp", "2"])
    assert option(command, "--link") == option(base, "--link")
    args = build_parser().parse_args(command[2:])
    assert args.tensor_parallel_size == 2 and args.executor == "torch"
    assert args.endpoint == option(base, "--link") and args.allow_remote
    assert kvserve_args(command).tensor_parallel_size == 2  # the `kvserve` CLI, as the container runs it


def test_tp2_executor_reserves_two_nvidia_gpus(compose: dict, tp2: dict, merged: dict) -> None:
    tp_size = kvserve_args(merged["services"]["executor"]["command"]).tensor_parallel_size
    assert nvidia_gpus(compose["services"]["executor"]) == [1]
    assert nvidia_gpus(merged["services"]["executor"]) == [tp_size] == [2]  # one GPU per rank, in one request
    # Only the tag makes the list replace the base's `count: 1`: Compose appends an untagged one to it.
    devices = tp2["services"]["executor"]["deploy"]["resources"]["reservations"]["devices"]
    assert isinstance(devices, Tagged) and devices.tag == "!override"
    untagged = {"services": {"executor": {"deploy": {"resources": {"reservations": {"devices": devices.value}}}}}}
    assert nvidia_gpus(merge_compose(compose, untagged)["services"]["executor"]) == [1, 2]


def test_tp2_executor_gets_a_larger_shm(compose: dict, merged: dict) -> None:
    """nccl between the ranks of one container uses /dev/shm."""
    shm = size_bytes(merged["services"]["executor"]["shm_size"])
    assert shm > size_bytes(compose["services"]["executor"]["shm_size"]) and shm >= 2 * 1024**3


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
    extra = os.environ.get("KVSERVE_COMPOSE")  # a Compose binary elsewhere, as scripts/container_test.sh takes it
    if extra and os.access(extra, os.X_OK):
        tools.append([extra])
    return tools


def _compose_version(tool: list[str]) -> tuple[int, ...]:
    out = subprocess.run([*tool, "version", "--short"], capture_output=True, text=True, timeout=60).stdout
    return tuple(int(n) for n in re.findall(r"\d+", out)[:3])


def _compose_config(tool: list[str], files: list[Path], cwd: Path) -> subprocess.CompletedProcess:
    argv = [*tool, "--project-directory", str(ROOT)]
    for path in files:
        argv += ["-f", str(path)]
    return subprocess.run([*argv, "config"], capture_output=True, text=True, timeout=120, cwd=cwd)


COMPOSE_TOOLS = _compose_tools()


@pytest.mark.skipif(not COMPOSE_TOOLS, reason="neither docker-compose nor `docker compose` is installed")
@pytest.mark.parametrize("tool", COMPOSE_TOOLS or [["docker-compose"]], ids=" ".join)
def test_docker_compose_config_accepts_the_file(tool: list[str], tmp_path: Path) -> None:
    """The tool's own schema check (no engine needed); Debian's docker-compose 1.29 is the strictest."""
    result = _compose_config(tool, [COMPOSE], tmp_path)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert set(resolved["services"]) == {"scheduler", "executor"}
    assert all(p.host_ip == "127.0.0.1" for p in published_ports(resolved["services"]["scheduler"]))


@pytest.mark.skipif(not COMPOSE_TOOLS, reason="neither docker-compose nor `docker compose` is installed")
@pytest.mark.parametrize("tool", COMPOSE_TOOLS or [["docker-compose"]], ids=" ".join)
def test_docker_compose_config_merges_the_tp2_override(tool: list[str], tmp_path: Path) -> None:
    """Compose v2.24.4+ replaces the GPU reservation (`!override`); Compose v1 refuses the file outright."""
    version = _compose_version(tool)
    result = _compose_config(tool, [COMPOSE, COMPOSE_TP2], tmp_path)
    if version < (2,):
        assert result.returncode != 0 and "!override" in result.stderr, result.stderr
        return
    if version < (2, 24, 4):
        pytest.skip(f"Compose {version} predates !override (2.24.4)")
    assert result.returncode == 0, result.stderr
    executor = yaml.safe_load(result.stdout)["services"]["executor"]
    assert nvidia_gpus(executor) == [2]
    assert kvserve_args(executor["command"]).tensor_parallel_size == 2
    assert size_bytes(executor["shm_size"]) >= 2 * 1024**3
    base = _compose_config(tool, [COMPOSE], tmp_path)
    assert base.returncode == 0, base.stderr
    assert (
        yaml.safe_load(result.stdout)["services"]["scheduler"] == yaml.safe_load(base.stdout)["services"]["scheduler"]
    )


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
