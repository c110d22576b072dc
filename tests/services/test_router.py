"""`kvserve router`: the real vllm-router binary in front of two fake-executor replicas.

`kv_aware` reads each replica's KV events: two long system prompts, each first served by a
different replica directly, must then be routed to the replica that holds them. Asserted on
each replica's own counters (finished requests and prefix-cache hit tokens), not on anything
the router says. `cache_aware` (the router's own prefix tree) keeps requests that share a long
token-id prefix on one replica. `round_robin` spreads the same requests over both.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from kvserve.testing.ports import free_ports
from kvserve.testing.replica_launcher import metric_total, serving_router
from kvserve.testing.server_launcher import ServeProcess
from tests.http.http_clients import FAKE_ARGS, token_file

pytestmark = pytest.mark.timeout(240)

PROMPTS = {
    0: "You are the keeper of a lighthouse on a rock in the northern sea, and you answer as one. " * 8,
    1: "You are a pirate captain who speaks only in riddles, and every answer rhymes with the last. " * 8,
}
ROUTED = 6
"""Requests per prompt sent through the router."""


def _counters(server: ServeProcess) -> tuple[float, float]:
    """(finished requests, prefix-cache hit tokens) from the replica's own /metrics."""
    assert server.http_url is not None
    return (
        metric_total(server.http_url, "kvserve:request_success_total"),
        metric_total(server.http_url, "kvserve:prefix_cache_hits_total"),
    )


def _chat(url: str, which: int, i: int) -> None:
    body = {
        "messages": [{"role": "system", "content": PROMPTS[which]}, {"role": "user", "content": f"Question {i}?"}],
        "max_tokens": 4,
    }
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


@pytest.fixture
def replicas(http_serve_factory) -> list[tuple[ServeProcess, str]]:
    """Two replicas, each publishing KV events: (server, its --kv-events-endpoint)."""
    out = []
    for _ in range(2):
        (port,) = free_ports(1)
        endpoint = f"tcp://127.0.0.1:{port}"
        out.append((http_serve_factory([*FAKE_ARGS, "--kv-events-endpoint", endpoint]), endpoint))
    return out


@pytest.fixture
def start_router(replicas) -> Iterator:
    with contextlib.ExitStack() as stack:

        def start(policy: str) -> str:
            args = ["--policy", policy]
            for server, endpoint in replicas:
                args += ["--worker-url", server.http_url, "--kv-events", f"{server.http_url}={endpoint}"]
            return stack.enter_context(serving_router(args))

        yield start


def test_kv_aware_sends_each_prefix_to_the_replica_that_holds_it(replicas, start_router) -> None:
    router = start_router("kv_aware")
    for which, (server, _) in enumerate(replicas):
        _chat(server.http_url, which, -1)  # served directly: replica `which` now holds prompt `which`
    before = [_counters(server) for server, _ in replicas]
    for i in range(ROUTED):
        for which in PROMPTS:
            _chat(router, which, i)
    for which, (server, _) in enumerate(replicas):
        finished, hits = _counters(server)
        assert finished - before[which][0] == ROUTED, f"replica {which} served only its own prefix's requests"
        assert hits - before[which][1] >= ROUTED * 100, "and each hit its cache"


TOKEN_PROMPTS = {0: list(range(1000, 1400)), 1: list(range(3000, 3400))}
"""Long token-id prompts: what vllm-router's `cache_aware` matches on (it skips text and chat)."""


def test_cache_aware_keeps_each_token_prefix_on_one_replica(replicas, start_router) -> None:
    router = start_router("cache_aware")
    for which, prefix in TOKEN_PROMPTS.items():
        before = [_counters(server)[0] for server, _ in replicas]
        for i in range(ROUTED):
            body = {"prompt": [*prefix, 5000 + i], "max_tokens": 4}
            response = httpx.post(router + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
        served = [_counters(server)[0] - before[k] for k, (server, _) in enumerate(replicas)]
        assert sorted(served) == [0, ROUTED], f"prefix {which}'s requests were split: {served}"


def test_round_robin_spreads_the_same_requests(replicas, start_router) -> None:
    router = start_router("round_robin")
    before = [_counters(server) for server, _ in replicas]
    for i in range(ROUTED):
        _chat(router, 0, i)
    served = [_counters(server)[0] - before[k][0] for k, (server, _) in enumerate(replicas)]
    assert sum(served) == ROUTED and min(served) >= ROUTED // 2 - 1, served


def test_kv_aware_without_event_sources_is_refused() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvserve", "router", "--worker-url", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--kv-events WORKER_URL=ENDPOINT" in out.stderr


def test_a_router_polls_health_and_load_without_a_token(http_serve_factory, tmp_path) -> None:
    server = http_serve_factory([*FAKE_ARGS, "--auth-token-file", str(token_file(tmp_path))])
    assert httpx.get(server.http_url + "/health", timeout=30).status_code == 200
    load = httpx.get(server.http_url + "/get_load", timeout=30)
    assert load.status_code == 200 and load.json() == {"load": 0}
    assert httpx.get(server.http_url + "/v1/models", timeout=30).status_code == 401, "the rest still needs one"
