"""Run `kvserve serve --data-parallel-size N`: N supervised replicas and the router in front.

Each replica is a whole `kvserve serve` (scheduler plus its own supervised executor), started
as `python -m kvserve serve ...` under a `ChildSupervisor`: when its scheduler dies (a crash,
a kill -9) the supervisor starts it again after a back-off (`--replica-restart-backoff-s`,
1 s) that doubles after each quick death up to 30 s and resets once a replica has run 30 s.
The router (`vllm-router`) is supervised the same way. The router's health checks (on each
replica's `/ready`) take a dead or restarting replica out of rotation and put it back when
it is ready again, so nothing here tells the router anything: this module only keeps the
processes alive and reports what the router sees.

Shutdown (SIGTERM or Ctrl-C) stops the router first, so no new request reaches a replica,
then SIGTERMs every replica at once; each drains its in-flight requests as a single
`kvserve serve` does.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import dataclass, field

import httpx
import structlog

from kvserve.child_python import python_module
from kvserve.replicas.replica_plan import ReplicaSetPlan
from kvserve.replicas.router_command import router_command
from kvserve.scheduler.server.executor_link.child_supervisor import ChildSupervisor

log = structlog.get_logger(__name__)

RESTART_BACKOFF_MAX_S = 30.0
ROUTER_STOP_TIMEOUT_S = 10.0
_STOP_MARGIN_S = 15.0
"""A replica gets its drain grace plus this to exit on SIGTERM before it is killed."""
_POLL_S = 0.5
_WATCH_POLL_S = 2.0
_HTTP_TIMEOUT_S = 5.0


@dataclass(slots=True)
class _Watch:
    """The router's last view of each replica, to report changes once, not every poll."""

    healthy: dict[str, bool] = field(default_factory=dict)

    def update(self, workers: dict[str, bool], plan: ReplicaSetPlan) -> None:
        for replica in plan.replicas:
            now = workers.get(replica.http_url, False)
            before = self.healthy.get(replica.http_url)
            if before is None and now:
                print(f"kvserve: replica {replica.index} healthy at {replica.http_url}", flush=True)
            elif before and not now:
                log.warning("replica_out_of_rotation", replica=replica.index, url=replica.http_url)
            elif before is False and now:
                log.info("replica_rejoined", replica=replica.index, url=replica.http_url)
            self.healthy[replica.http_url] = now


def run_replica_set(plan: ReplicaSetPlan, router_executable: str, *, drain_grace_s: float) -> int:
    """Start everything, wait for SIGTERM/SIGINT, stop everything; the exit code."""
    return asyncio.run(_run(plan, router_executable, drain_grace_s))


async def _run(plan: ReplicaSetPlan, router_executable: str, drain_grace_s: float) -> int:
    shutdown = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown.set)
    replicas = [
        ChildSupervisor(
            python_module("kvserve", "serve", *replica.serve_args),
            name="replica",
            log_fields={"replica": replica.index, "url": replica.http_url},
            env={**os.environ, **replica.env},
            backoff_initial_s=plan.restart_backoff_s,
            backoff_max_s=max(RESTART_BACKOFF_MAX_S, plan.restart_backoff_s),
            stop_timeout_s=drain_grace_s + _STOP_MARGIN_S,
        )
        for replica in plan.replicas
    ]
    router = ChildSupervisor(
        router_command(plan.router, router_executable),
        name="router",
        log_fields={"url": plan.router_url},
        backoff_initial_s=1.0,
        backoff_max_s=RESTART_BACKOFF_MAX_S,
        stop_timeout_s=ROUTER_STOP_TIMEOUT_S,
    )
    log.info("replica_set_starting", replicas=len(replicas), policy=plan.router.policy, url=plan.router_url)
    code = 0
    async with httpx.AsyncClient(base_url=_reachable(plan.router_url), timeout=_HTTP_TIMEOUT_S) as client:
        try:
            for supervisor in replicas:
                await supervisor.start()
            await router.start()
            watch = _Watch()
            children = [(f"replica {r.index}", s) for r, s in zip(plan.replicas, replicas)] + [("the router", router)]
            code = await _until_ready(client, plan, children, watch, shutdown)
            if code == 0 and not shutdown.is_set():
                grpc = ", ".join(str(r.grpc_port) for r in plan.replicas if r.grpc_port)
                print(
                    f"kvserve: serving {len(replicas)} replicas behind vllm-router ({plan.router.policy}) on "
                    f"{plan.router_url} (OpenAI HTTP API)" + (f"; gRPC per replica on ports {grpc}" if grpc else ""),
                    flush=True,
                )
                log.info("replica_set_ready", replicas=len(replicas), url=plan.router_url)
                await _watch_until(client, plan, watch, shutdown)
        finally:
            log.info("replica_set_stopping")
            await router.stop()
            await asyncio.gather(*(supervisor.stop() for supervisor in replicas))
            log.info("replica_set_stopped", restarts=sum(s.restarts for s in replicas))
    return code


async def _until_ready(
    client: httpx.AsyncClient,
    plan: ReplicaSetPlan,
    children: list[tuple[str, ChildSupervisor]],
    watch: _Watch,
    shutdown: asyncio.Event,
) -> int:
    """0 once the router sees every replica healthy; 1 if a child (a replica, or the router,
    say on a bad --router-args) exits before that: starting it again would only fail again."""
    while not shutdown.is_set():
        for name, supervisor in children:
            if not supervisor.exits.empty():
                code = supervisor.exits.get_nowait()
                print(
                    f"kvserve: {name} exited with code {code} while starting; its log is above",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
        workers = await _router_workers(client)
        if workers is not None:
            watch.update(workers, plan)
            if len(workers) == len(plan.replicas) and all(workers.values()):
                return 0
        await _wait(shutdown, _POLL_S)
    return 0


async def _watch_until(client: httpx.AsyncClient, plan: ReplicaSetPlan, watch: _Watch, shutdown: asyncio.Event) -> None:
    """Log each replica leaving and rejoining the router's rotation until shutdown."""
    while not await _wait(shutdown, _WATCH_POLL_S):
        workers = await _router_workers(client)
        if workers is not None:
            watch.update(workers, plan)


async def _router_workers(client: httpx.AsyncClient) -> dict[str, bool] | None:
    """The router's `GET /workers`: each worker URL and whether its health checks pass; None
    while the router does not answer (starting, or restarting)."""
    try:
        response = await client.get("/workers")
        response.raise_for_status()
        return {w["url"]: bool(w.get("is_healthy")) for w in response.json().get("workers", [])}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


async def _wait(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether `event` was set within `timeout_s`."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True


def _reachable(url: str) -> str:
    """The router's URL as this host reaches it: a wildcard bind is polled on loopback."""
    for wildcard in ("0.0.0.0", "[::]"):
        url = url.replace(f"//{wildcard}:", "//127.0.0.1:")
    return url
