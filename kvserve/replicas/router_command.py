"""The `vllm-router` command line: the one place kvserve's router defaults live.

`kvserve router` (replicas on any hosts) and `kvserve serve --data-parallel-size N` (replicas
it starts itself) both build the router's argv here, so the two never disagree on a policy
name, a health-check interval or how KV-event sources are passed.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.config import defaults
from kvserve.config.flags import flag

POLICIES = ("kv_aware", "cache_aware", "consistent_hash", "power_of_two", "round_robin")
ROUTER_PORT = 8080
ROUTER_METRICS_PORT = 29000
ROUTER_MISSING = "vllm-router is not installed: pip install vllm-router (make setup installs it)"
KV_EVENTS_MODEL = "kvserve"
"""The model identity kv_aware groups event sources by; every replica serves the same model."""


@dataclass(slots=True)
class RouterConfig:
    worker_url: tuple[str, ...] = field(
        default=(), metadata=flag("a replica's HTTP API (http://HOST:PORT); repeat for each", metavar="URL")
    )
    kv_events: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "WORKER_URL=ENDPOINT: that replica's --kv-events-endpoint, for kv_aware; repeat for each",
            metavar="URL=ENDPOINT",
        ),
    )
    kv_events_replay: tuple[str, ...] = field(
        default=(),
        metadata=flag("WORKER_URL=ENDPOINT: that replica's --kv-events-replay-endpoint", metavar="URL=ENDPOINT"),
    )
    policy: str = field(default="kv_aware", metadata=flag("how requests are spread", choices=POLICIES))
    host: str = field(default=defaults.GRPC_HOST, metadata=flag("address the router listens on"))
    port: int = field(default=ROUTER_PORT, metadata=flag("port the router listens on (OpenAI HTTP API)"))
    block_size: int = field(default=defaults.BLOCK_SIZE, metadata=flag("the replicas' --block-size (kv_aware)"))
    health_check_interval_s: int = field(
        default=2, metadata=flag("seconds between health checks of each replica (a dead one leaves rotation)")
    )
    health_failure_threshold: int = field(
        default=2, metadata=flag("failed health checks before a replica leaves rotation")
    )
    health_check_endpoint: str = field(
        default="/ready",
        metadata=flag(
            "the replicas' route the router's health checks call: /ready answers 200 only while the executor "
            "is registered and stepping and the replica is not draining (/health: while the process runs)"
        ),
    )
    metrics_port: int = field(
        default=ROUTER_METRICS_PORT, metadata=flag("port of the router's own Prometheus /metrics")
    )
    router_args: str = field(default="", metadata=flag("more `vllm-router` options, shell-quoted"))


class RouterConfigError(ValueError):
    """The options cannot make a working router (exit code 2)."""


def router_command(config: RouterConfig, executable: str) -> list[str]:
    """The `vllm-router` command line for `config`."""
    if not config.worker_url:
        raise RouterConfigError("give each replica's HTTP API with --worker-url http://HOST:PORT")
    for url in config.worker_url:
        if not url.startswith(("http://", "https://")):
            raise RouterConfigError(f"--worker-url {url!r}: expected http://HOST:PORT")
    sources = _pairs(config.kv_events, "--kv-events", config.worker_url)
    replays = _pairs(config.kv_events_replay, "--kv-events-replay", config.worker_url)
    if config.policy == "kv_aware" and set(sources) != set(config.worker_url):
        raise RouterConfigError(
            "--policy kv_aware needs --kv-events WORKER_URL=ENDPOINT for every replica (start each with "
            "--kv-events-endpoint); or pick another --policy"
        )
    command = [
        executable,
        *("--host", config.host, "--port", str(config.port)),
        *("--worker-urls", *config.worker_url),
        *("--policy", config.policy),
        *("--health-check-interval-secs", str(config.health_check_interval_s)),
        *("--health-failure-threshold", str(config.health_failure_threshold)),
        *("--health-check-endpoint", config.health_check_endpoint),
        *("--worker-startup-check-interval", "1"),
        *("--prometheus-host", config.host, "--prometheus-port", str(config.metrics_port)),
    ]
    if config.policy == "kv_aware":  # vllm-router takes event sources for kv_aware only
        for url, endpoint in sources.items():
            command += ["--kv-event-source", f"{url}={endpoint}"]
        for url, endpoint in replays.items():
            command += ["--kv-event-replay-source", f"{url}={endpoint}"]
        command += ["--kv-event-block-size", str(config.block_size), "--kv-event-model", KV_EVENTS_MODEL]
    return command + shlex.split(config.router_args)


def _pairs(values: tuple[str, ...], flag_name: str, workers: tuple[str, ...]) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for value in values:
        url, sep, endpoint = value.partition("=")
        if not sep or not endpoint:
            raise RouterConfigError(f"{flag_name} {value!r}: expected WORKER_URL=ENDPOINT")
        if url not in workers:
            raise RouterConfigError(f"{flag_name} {value!r}: {url} is not a --worker-url")
        pairs[url] = endpoint
    return pairs


def find_router() -> str | None:
    """The `vllm-router` console script: beside this Python first (the venv), then on PATH."""
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.is_file() else shutil.which("vllm-router")
