"""`kvserve stats --router URL`: the router's readiness and each replica's health, from both sides.

The router (`kvserve router`, i.e. vllm-router) is asked for `/readiness` and `/workers`; each
worker it lists is then asked itself for `/ready` and `/get_load`, two routes a kvserve
replica serves without a token. So a replica the router still counts healthy but that no
longer answers (or the reverse, one back up that the router has not re-admitted yet) shows.

Measured with vllm-router 0.1.17: `/readiness` is 200 `{"status":"ready","healthy_workers":..}`
while a worker is healthy, else 503 `{"status":"not_ready","reason":..}` (no healthy count);
`/workers` keeps listing a worker it marked unhealthy, and its `load` there is the router's
own count of requests in flight to it, not the replica's queue (that is the replica's `/get_load`).
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

EXIT_DEGRADED = 1
"""The router is not ready, or some replica is unhealthy (in the router's view or its own)."""
EXIT_UNREACHABLE = 2
"""The router did not answer, or not as vllm-router does."""
DEFAULT_TIMEOUT_S = 5.0
"""Each HTTP call's timeout when `--timeout` is not given (gRPC's "no deadline" would hang on a dead host)."""


class RouterUnreachable(Exception):
    """The router did not answer `/readiness` and `/workers` as vllm-router does."""


@dataclass(frozen=True, slots=True)
class ReplicaView:
    url: str
    router_healthy: bool
    router_load: int | None
    """Requests the router has in flight to this replica (`/workers`)."""
    health: str
    """The replica's own `/ready` (what the router's health checks call): "ok", "HTTP <code>", "unreachable"."""
    load: int | None
    """The replica's own `/get_load` (running + waiting); None when it did not answer."""

    @property
    def healthy(self) -> bool:
        return self.router_healthy and self.health == "ok"


@dataclass(frozen=True, slots=True)
class RouterView:
    url: str
    status: str
    """`/readiness`'s status: "ready", "not_ready"."""
    ready: bool
    reason: str | None
    replicas: tuple[ReplicaView, ...]

    @property
    def healthy_workers(self) -> int:
        return sum(replica.router_healthy for replica in self.replicas)

    @property
    def ok(self) -> bool:
        return self.ready and all(replica.healthy for replica in self.replicas)

    def as_json(self) -> dict[str, Any]:
        return {
            "router": {
                "url": self.url,
                "status": self.status,
                "ready": self.ready,
                "reason": self.reason,
                "healthy_workers": self.healthy_workers,
                "total_workers": len(self.replicas),
            },
            "replicas": [{**asdict(replica), "healthy": replica.healthy} for replica in self.replicas],
            "ok": self.ok,
        }


def router_view(url: str, timeout_s: float) -> RouterView:
    """Ask the router, then each replica it lists; RouterUnreachable when the router does not answer."""
    import httpx  # here, not at the top: `kvserve --help` imports every command module

    url = url.rstrip("/")
    with httpx.Client(timeout=timeout_s) as client:
        try:
            readiness = client.get(url + "/readiness")
            workers = client.get(url + "/workers")
            workers.raise_for_status()
            ready_body, workers_body = readiness.json(), workers.json()
            listed = [(str(w["url"]), bool(w["is_healthy"]), w.get("load")) for w in workers_body["workers"]]
            status, reason = str(ready_body["status"]), ready_body.get("reason")
        except (httpx.HTTPError, httpx.InvalidURL, ValueError, KeyError, TypeError, AttributeError) as error:
            raise RouterUnreachable(f"{type(error).__name__}: {error}") from error
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(listed)))) as pool:
            futures = [pool.submit(_replica, client, *worker) for worker in listed]
            replicas = tuple(future.result() for future in futures)
    return RouterView(
        url=url,
        status=status,
        ready=readiness.status_code == 200 and status == "ready",
        reason=None if reason is None else str(reason),
        replicas=replicas,
    )


def _replica(client: httpx.Client, url: str, router_healthy: bool, router_load: Any) -> ReplicaView:
    import httpx

    base = url.rstrip("/")
    try:
        response = client.get(base + "/ready")
        health = "ok" if response.status_code == 200 else f"HTTP {response.status_code}"
    except httpx.HTTPError:
        health = "unreachable"
    load = None
    if health != "unreachable":
        try:
            answer = client.get(base + "/get_load")
            load = int(answer.json()["load"]) if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            load = None
    return ReplicaView(
        url=url,
        router_healthy=router_healthy,
        router_load=router_load if isinstance(router_load, int) else None,
        health=health,
        load=load,
    )


def render(view: RouterView) -> str:
    """The router's line, then one line per replica."""
    readiness = f"{view.status} ({view.healthy_workers}/{len(view.replicas)} healthy)"
    lines = [f"router: {view.url}  {readiness}" + (f": {view.reason}" if view.reason else "")]
    rows = [("replica", "router", "router_load", "health", "load")]
    for replica in view.replicas:
        rows.append(
            (
                replica.url,
                "healthy" if replica.router_healthy else "unhealthy",
                _dash(replica.router_load),
                replica.health,
                _dash(replica.load),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def _dash(value: int | None) -> str:
    return "-" if value is None else str(value)


def run(url: str, timeout_s: float | None, *, as_json: bool) -> int:
    """Print the router's view (text or one JSON object); the exit code: 0 ok, 1 degraded, 2 unreachable."""
    if not url.startswith(("http://", "https://")):
        print(f"kvserve stats: --router {url!r}: expected http://HOST:PORT", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        view = router_view(url, DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    except RouterUnreachable as error:
        print(f"kvserve stats: router {url} unreachable: {error}", file=sys.stderr)
        return EXIT_UNREACHABLE
    print(json.dumps(view.as_json()) if as_json else render(view))
    return 0 if view.ok else EXIT_DEGRADED
