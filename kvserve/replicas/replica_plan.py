"""What each replica of `kvserve serve --data-parallel-size N` gets: ports, devices, threads.

Pure planning, no processes: `plan_replicas` turns the one command line the user gave into N
`kvserve serve` command lines (each a whole engine: scheduler, executor, its own ports) and the
router's. Replica *i* keeps the public gRPC API at `--port` + *i* (gRPC clients balance over
them themselves, docs/scale-out.md), while its HTTP API and KV events live on loopback ports
from `--replica-ports-from` on, behind the router, which takes the public `--http-port`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from kvserve.config.defaults import REPLICA_ENV
from kvserve.config.flags import config_to_argv, flag
from kvserve.replicas.router_command import POLICIES, ROUTER_METRICS_PORT, RouterConfig
from kvserve.scheduler.server.security.bind_policy import BindSecurity, InsecureBindError, check_bind
from kvserve.scheduler.server.server_config import ServerConfig

_DATA_PARALLEL = "data parallel (replicas behind vllm-router)"
SECTION = _DATA_PARALLEL
"""The --help section of DataParallelConfig's flags."""
REPLICA_HOST = "127.0.0.1"
"""Replicas' HTTP APIs and KV events stay on loopback: only the router is reached from outside."""
_TCP = re.compile(r"^tcp://(?P<host>[^:/]+|\[[^\]]+\]):(?P<port>\d+)$")


@dataclass(slots=True)
class DataParallelConfig:
    """`kvserve serve`'s options for running several replicas behind the router."""

    data_parallel_size: int = field(
        default=1,
        metadata=flag(
            "independent engines (each a scheduler and an executor) behind vllm-router on --http-port; "
            "on CPU they divide the cores, on GPUs each takes --tensor-parallel-size devices",
            aliases=("-dp",),
            metavar="N",
            group=_DATA_PARALLEL,
        ),
    )
    router_policy: str = field(
        default="kv_aware",
        metadata=flag(
            "how the router spreads requests: kv_aware follows the replicas' KV events (prefix affinity for "
            "text, chat and token prompts); cache_aware only for token-id prompts (docs/scale-out.md)",
            choices=POLICIES,
            group=_DATA_PARALLEL,
        ),
    )
    replica_ports_from: int | None = field(
        default=None,
        metadata=flag(
            "first of the loopback ports the replicas use: HTTP at PORT+i, KV events at PORT+N+2i and their "
            "replay at PORT+N+2i+1; None: --http-port + 1",
            metavar="PORT",
            group=_DATA_PARALLEL,
        ),
    )
    replica_restart_backoff_s: float = field(
        default=1.0,
        metadata=flag(
            "seconds before a dead replica is restarted; doubles after each quick death, up to 30 s, and "
            "resets once a replica has run 30 s",
            metavar="S",
            group=_DATA_PARALLEL,
        ),
    )
    router_metrics_port: int = field(
        default=ROUTER_METRICS_PORT,
        metadata=flag("port of the router's own Prometheus /metrics", group=_DATA_PARALLEL),
    )
    router_args: str = field(
        default="", metadata=flag("more `vllm-router` options, shell-quoted", group=_DATA_PARALLEL)
    )


class ReplicaPlanError(ValueError):
    """The options cannot make N working replicas (exit code 2)."""


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    """One replica: its `kvserve serve` options, environment additions and where it answers."""

    index: int
    serve_args: list[str]
    env: dict[str, str]
    http_url: str
    grpc_port: int
    kv_events_endpoint: str | None
    kv_events_replay_endpoint: str | None


@dataclass(frozen=True, slots=True)
class ReplicaSetPlan:
    replicas: list[ReplicaPlan]
    router: RouterConfig
    router_url: str
    restart_backoff_s: float


@dataclass(frozen=True, slots=True)
class ExecutorShape:
    """What of `kvserve serve`'s executor options the plan needs (all of them pass through as argv)."""

    kind: str
    """--executor"""
    tensor_parallel_size: int
    block_size: int
    device: str = "auto"
    """--device"""
    num_threads: int | None = None
    """--num-threads; None: the plan shares the cores out between CPU replicas"""


def plan_replicas(
    dp: DataParallelConfig,
    server: ServerConfig,
    serve_args: list[str],
    executor: ExecutorShape,
    *,
    gpus: list[str] | None = None,
    cores: int | None = None,
) -> ReplicaSetPlan:
    """N replicas and the router for one `kvserve serve --data-parallel-size N` command line.

    `serve_args` are the serve command's own and its executor's options (`kvserve.commands.serve.serve_argv`),
    passed to every replica; `gpus`/`cores` default to this host's (tests pass them)."""
    n = dp.data_parallel_size
    if n < 1:
        raise ReplicaPlanError(f"--data-parallel-size {n}: expected 1 or more")
    if not dp.replica_restart_backoff_s > 0:
        raise ReplicaPlanError(f"--replica-restart-backoff-s {dp.replica_restart_backoff_s}: expected > 0")
    if not server.http_port:
        raise ReplicaPlanError("--data-parallel-size needs the HTTP API: the router serves it (--http-port)")
    if server.tls_cert is not None:
        raise ReplicaPlanError(
            "--data-parallel-size with --tls-cert: the router serves plain HTTP; terminate TLS in front of it"
        )
    router_host = server.http_host or server.host
    try:
        check_bind(BindSecurity(router_host, bool(server.auth_token_file), False, server.allow_insecure_remote))
    except InsecureBindError as exc:
        raise ReplicaPlanError(str(exc)) from None
    base = dp.replica_ports_from if dp.replica_ports_from is not None else server.http_port + 1
    if base <= 0 or base + 3 * n > 65536:
        raise ReplicaPlanError(f"--replica-ports-from {base}: needs {3 * n} ports from there")
    kv_aware = dp.router_policy == "kv_aware"
    devices = _split_devices(executor, n, host_gpus() if gpus is None else gpus)
    threads = None if devices or executor.kind != "torch" else _threads_per_replica(n, cores)
    replicas = []
    for i in range(n):
        http_port = base + i
        events = replay = None
        if server.kv_events_endpoint is not None:
            events = _offset(server.kv_events_endpoint, i, "--kv-events-endpoint")
        elif kv_aware:
            events = f"tcp://{REPLICA_HOST}:{base + n + 2 * i}"
        if server.kv_events_replay_endpoint is not None:
            replay = _offset(server.kv_events_replay_endpoint, i, "--kv-events-replay-endpoint")
        elif kv_aware:
            replay = f"tcp://{REPLICA_HOST}:{base + n + 2 * i + 1}"
        replica_server = dataclasses.replace(
            server,
            port=server.port + i if server.port else 0,
            http_host=REPLICA_HOST,
            http_port=http_port,
            metrics_port=server.metrics_port + i if server.metrics_port else server.metrics_port,
            link=_offset(server.link, i, "--link") if server.link else "",
            kv_events_endpoint=events,
            kv_events_replay_endpoint=replay,
        )
        args = [*serve_args, *config_to_argv(replica_server)]
        if threads is not None and executor.num_threads is None:
            args += ["--num-threads", str(threads)]
        env = {REPLICA_ENV: str(i)}
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[i])
        replicas.append(
            ReplicaPlan(
                index=i,
                serve_args=args,
                env=env,
                http_url=f"http://{REPLICA_HOST}:{http_port}",
                grpc_port=replica_server.port,
                kv_events_endpoint=events,
                kv_events_replay_endpoint=replay,
            )
        )
    router = RouterConfig(
        worker_url=tuple(r.http_url for r in replicas),
        kv_events=tuple(f"{r.http_url}={r.kv_events_endpoint}" for r in replicas if r.kv_events_endpoint),
        kv_events_replay=tuple(
            f"{r.http_url}={r.kv_events_replay_endpoint}" for r in replicas if r.kv_events_replay_endpoint
        ),
        policy=dp.router_policy,
        host=router_host,
        port=server.http_port,
        block_size=executor.block_size,
        metrics_port=dp.router_metrics_port,
        router_args=dp.router_args,
    )
    shown_host = f"[{router_host}]" if ":" in router_host else router_host
    return ReplicaSetPlan(
        replicas=replicas,
        router=router,
        router_url=f"http://{shown_host}:{server.http_port}",
        restart_backoff_s=dp.replica_restart_backoff_s,
    )


def host_gpus() -> list[str]:
    """This host's visible GPUs, without CUDA: CUDA_VISIBLE_DEVICES when set, else `nvidia-smi -L`."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in (part.strip() for part in visible.split(",")) if d and d != "-1"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def _split_devices(executor: ExecutorShape, n: int, gpus: list[str]) -> list[list[str]]:
    """Replica i's GPUs: the i-th slice of tensor_parallel_size; none for CPU or the fake executor."""
    if executor.kind != "torch" or not gpus or executor.device == "cpu":
        return []
    need = n * executor.tensor_parallel_size
    if need > len(gpus):
        raise ReplicaPlanError(
            f"--data-parallel-size {n} × --tensor-parallel-size {executor.tensor_parallel_size} needs {need} GPUs; "
            f"{len(gpus)} visible ({','.join(gpus)})"
        )
    tp = executor.tensor_parallel_size
    return [gpus[i * tp : (i + 1) * tp] for i in range(n)]


def _threads_per_replica(n: int, cores: int | None) -> int:
    """Each CPU replica's executor threads: the cores less one per replica for its scheduler, shared out."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, (cores - n) // n)


def _offset(endpoint: str, i: int, flag_name: str) -> str:
    """Replica i's copy of an endpoint the user gave for all: tcp port + i, ipc path + `.i`."""
    if i == 0:
        return endpoint
    if endpoint.startswith("ipc://"):
        return f"{endpoint}.{i}"
    match = _TCP.match(endpoint)
    if match is None or int(match["port"]) == 0:
        raise ReplicaPlanError(f"{flag_name} {endpoint!r}: with --data-parallel-size, give tcp://HOST:PORT or ipc://")
    return f"tcp://{match['host']}:{int(match['port']) + i}"
