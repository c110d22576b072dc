"""`kvserve stats --router URL` against the real vllm-router in front of two fake-executor replicas.

Both healthy: exit 0 and both named. One stopped: once the router's own health checks have
marked it unhealthy, exit 1 with that replica down in both views. A router that is not
there: exit 2 with one line on stderr, no traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from kvserve.testing.ports import free_ports
from kvserve.testing.replica_launcher import serving_router
from kvserve.testing.server_launcher import ServeProcess
from kvserve.testing.waiting import wait_until
from tests.http.http_clients import FAKE_ARGS

pytestmark = pytest.mark.timeout(240)

CLI_TIMEOUT_S = 60


def _stats(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvserve", "stats", *args], capture_output=True, text=True, timeout=CLI_TIMEOUT_S
    )


@pytest.fixture
def replicas(http_serve_factory) -> list[ServeProcess]:
    return [http_serve_factory(FAKE_ARGS) for _ in range(2)]


@pytest.fixture
def router(replicas) -> Iterator[str]:
    args = ["--policy", "round_robin"]
    for server in replicas:
        args += ["--worker-url", server.http_url]
    with serving_router(args) as url:
        yield url


def _router_healthy(router: str) -> dict[str, bool]:
    workers = httpx.get(router + "/workers", timeout=5).json()["workers"]
    return {worker["url"]: worker["is_healthy"] for worker in workers}


def test_stats_shows_the_router_and_each_replica_and_a_stopped_one_as_down(replicas, router) -> None:
    urls = [server.http_url for server in replicas]
    wait_until(lambda: all(_router_healthy(router).get(url) for url in urls), 60, "both replicas healthy")

    result = _stats("--router", router, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    body = json.loads(result.stdout)
    assert body["ok"] is True
    assert body["router"] == {
        "url": router,
        "status": "ready",
        "ready": True,
        "reason": None,
        "healthy_workers": 2,
        "total_workers": 2,
    }
    by_url = {replica["url"]: replica for replica in body["replicas"]}
    assert set(by_url) == set(urls)
    for replica in by_url.values():
        assert replica["router_healthy"] and replica["healthy"] and replica["health"] == "ok", replica
        assert replica["load"] == 0, "an idle replica's own /get_load"

    text = _stats("--router", router)
    assert text.returncode == 0, text.stderr
    assert f"router: {router}  ready (2/2 healthy)" in text.stdout
    for url in urls:
        line = next(line for line in text.stdout.splitlines() if line.startswith(url))
        assert line.split()[1:] == ["healthy", "0", "ok", "0"], line

    stopped, alive = replicas
    stopped.stop()
    wait_until(
        lambda: _router_healthy(router).get(stopped.http_url) is False,
        60,
        f"the router to mark {stopped.http_url} unhealthy",
    )

    result = _stats("--router", router, "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    body = json.loads(result.stdout)
    assert body["ok"] is False and body["router"]["healthy_workers"] == 1 and body["router"]["total_workers"] == 2
    by_url = {replica["url"]: replica for replica in body["replicas"]}
    down = by_url[stopped.http_url]
    seen = (down["router_healthy"], down["health"], down["load"], down["healthy"])
    assert seen == (False, "unreachable", None, False), down
    assert by_url[alive.http_url]["healthy"] is True

    text = _stats("--router", router)
    assert text.returncode == 1, text.stderr
    line = next(line for line in text.stdout.splitlines() if line.startswith(stopped.http_url))
    assert line.split()[1:] == ["unhealthy", "0", "unreachable", "-"], line
    assert "(1/2 healthy)" in text.stdout


def test_an_unreachable_router_exits_2_with_one_line() -> None:
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    for args in (["--router", url], ["--router", url, "--json", "--timeout", "2"]):
        result = _stats(*args)
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stdout == "" and "Traceback" not in result.stderr
        assert result.stderr.startswith(f"kvserve stats: router {url} unreachable: ConnectError"), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_a_router_url_without_a_scheme_is_refused() -> None:
    result = _stats("--router", "127.0.0.1:8080")
    assert result.returncode == 2 and "expected http://HOST:PORT" in result.stderr and "Traceback" not in result.stderr
