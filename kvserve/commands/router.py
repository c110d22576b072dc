"""`kvserve router`: vLLM's router (`vllm-router`, from PyPI) in front of kvserve replicas, with kvserve's defaults.

kvserve grows no router of its own: this command builds the `vllm-router` command line and
execs it. What the router asks of a worker, kvserve's HTTP API serves: `/health` (its health
checks), the OpenAI routes, `/tokenize` (which `kv_aware` calls to count a request's prefix
in tokens), `/get_load` (`power_of_two`) and, with `--kv-events-endpoint` on each replica,
vLLM's KV events, which `kv_aware` reads to know which replica holds which prefix.

Policies, as measured with vllm-router 0.1.17 (docs/scale-out.md): `kv_aware` (the default)
routes a chat or completion to the replica whose prefix cache holds most of its prompt;
`cache_aware` keeps affinity only for token-id prompts, not text or chat; `consistent_hash`
keeps a session on one replica by its `x-session-id` header; `round_robin` and
`power_of_two` only balance.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.config import defaults
from kvserve.config.flags import HelpFormatter, add_flags, config_from_args, flag

POLICIES = ("kv_aware", "cache_aware", "consistent_hash", "power_of_two", "round_robin")
ROUTER_PORT = 8080
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
    metrics_port: int = field(default=29000, metadata=flag("port of the router's own Prometheus /metrics"))
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


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "router",
        help="run vLLM's router (vllm-router) in front of kvserve replicas",
        description="Fronts `kvserve serve` replicas (on this host or others) with vllm-router from PyPI,\n"
        "on one OpenAI-compatible HTTP port. kv_aware (the default) reads each replica's KV\n"
        "events (start replicas with --kv-events-endpoint) and sends a request to the replica\n"
        "that holds most of its prefix. See docs/scale-out.md.",
        formatter_class=HelpFormatter,
    )
    add_flags(parser, RouterConfig)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(RouterConfig, args)
    executable = find_router()
    if executable is None:
        print(
            "kvserve: vllm-router is not installed: pip install vllm-router (make setup installs it)", file=sys.stderr
        )
        return 2
    try:
        command = router_command(config, executable)
    except RouterConfigError as exc:
        print(f"kvserve: {exc}", file=sys.stderr)
        return 2
    print(f"kvserve: routing {len(config.worker_url)} replicas with {config.policy} on {config.host}:{config.port}")
    sys.stdout.flush()
    os.execv(command[0], command)
    return 0  # pragma: no cover - execv does not return
