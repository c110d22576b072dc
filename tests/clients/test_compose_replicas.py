"""docker-compose.replicas.yml run, not just parsed: two kvserve replicas and vLLM's router in front.

tests/clients/compose_services.py turns the services into local processes as it does for
docker-compose.yml, with ports per service: both replicas listen on 50051, 8000 and 5557 in
their containers, so each gets free ports of its own, and the router's `http://replica-a:8000`
and `tcp://replica-b:5557` become that replica's local ports. The replicas run the fake
executor. The run needs every healthcheck from the file to exit 0 (in depends_on order), the
router's /workers to list both replicas healthy, a chat completion through the router's
published port with the official `openai` SDK, plain and streamed, and each service gone with
exit 0 within its stop_grace_period of SIGTERM (vllm-router 0.1.17 shuts down gracefully on
SIGTERM and exits 0, so the router gets no exception). The checker is shown to fail on broken
copies of the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kvserve.link.endpoint import is_loopback_host
from kvserve.testing.replica_launcher import metric_total
from kvserve.testing.waiting import wait_until
from tests.clients.compose_services import (
    LOOPBACK,
    ROOT,
    ComposeError,
    Running,
    check_compose,
    kill_all,
    kvserve_args,
    listens,
    load_compose,
    localize,
    localize_services,
    published_address,
    published_ports,
    start_healthy,
    stop,
)

pytestmark = pytest.mark.timeout(600)

REPLICAS_COMPOSE = ROOT / "docker-compose.replicas.yml"
REPLICAS = ("replica-a", "replica-b")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def load_replicas() -> dict:
    return load_compose(REPLICAS_COMPOSE)


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


@pytest.fixture
def replicas_up(scratch: Path) -> Iterator:
    """`up()`: the localized services started in order, each healthy before its dependents start."""
    started: list[Running] = []

    def up() -> tuple[dict[str, Running], dict[tuple[str, int], int]]:
        compose = load_replicas()
        assert check_compose(compose) == []
        services, port_map = localize_services(compose, scratch, executor="fake")
        return start_healthy(services, scratch, started), port_map

    yield up
    kill_all(started)


def _finished(http_url: str) -> float:
    """A replica's finished requests, from its own /metrics."""
    return metric_total(http_url, "kvserve:request_success_total")


def test_replicas_and_router_come_up_answer_and_stop(replicas_up) -> None:
    running, port_map = replicas_up()
    assert list(running) == ["replica-a", "replica-b", "router"]  # depends_on order
    router = running["router"]
    host, port = published_address(router, port_map[("router", 8080)])
    url = f"http://{host}:{port}"
    replica_urls = {name: f"http://{LOOPBACK}:{port_map[(name, 8000)]}" for name in REPLICAS}

    def workers() -> list[dict]:
        return httpx.get(f"{url}/workers", timeout=30).json()["workers"]

    def both_healthy() -> bool:
        return sum(w["is_healthy"] for w in workers()) == 2

    wait_until(both_healthy, 60, "the router's /workers to list both replicas healthy", interval_s=0.2)
    assert {w["url"] for w in workers()} == set(replica_urls.values())
    assert httpx.get(f"{url}/readiness", timeout=30).json() == {
        "status": "ready",
        "healthy_workers": 2,
        "total_workers": 2,
    }
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    for name, replica in replica_urls.items():  # what the router sends in a container: Host: replica-a:8000
        assert httpx.get(f"{replica}/health", headers={"host": f"{name}:8000"}, timeout=30).status_code == 200
    before = sum(_finished(replica) for replica in replica_urls.values())

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    (model,) = [m.id for m in client.models.list().data]
    completion = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("length", "stop") and 0 < completion.usage.completion_tokens <= 8
    stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    after = sum(_finished(replica) for replica in replica_urls.values())
    assert after - before == 2, "each request reached a replica once"

    for name in reversed(list(running)):  # in start order; compose stops dependents first
        stop(running[name])


# --- the file, read ----------------------------------------------------------------------------


def test_the_replicas_file_hangs_together() -> None:
    assert check_compose(load_replicas()) == []


def test_two_replicas_on_two_gpus_and_only_the_router_published() -> None:
    compose = load_replicas()
    services = compose["services"]
    assert set(services) == {"replica-a", "replica-b", "router"} and "name" not in compose
    assert len({s["image"] for s in services.values()}) == 1
    gpus = []
    for name in REPLICAS:
        command = services[name]["command"]
        assert command[:2] == ["kvserve", "serve"] and option(command, "--allowed-hosts") == name
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        gpus += device["device_ids"]
        assert "ports" not in services[name]  # reached over the compose network only
        assert services["router"]["depends_on"][name]["condition"] == "service_healthy"
    assert sorted(gpus) == ["0", "1"]
    assert services["replica-b"]["depends_on"]["replica-a"]["condition"] == "service_healthy"
    router = kvserve_args(services["router"]["command"])
    assert router.command == "router" and router.policy == "kv_aware" and len(router.worker_url) == 2
    (published,) = published_ports(services["router"])
    assert (published.host_ip, published.published, published.target) == ("127.0.0.1", 8080, router.port)
    assert is_loopback_host(published.host_ip)


def test_localize_gives_each_replica_its_own_ports(tmp_path: Path) -> None:
    compose = load_replicas()
    services, port_map = localize_services(compose, tmp_path, executor="fake")
    assert set(port_map) == {
        *((name, port) for name in REPLICAS for port in (50051, 8000, 5557)),
        ("router", 8080),
        ("router", 29000),
    }
    assert len(set(port_map.values())) == len(port_map)
    router = services["router"]["command"]
    for name in REPLICAS:
        http, events = port_map[(name, 8000)], port_map[(name, 5557)]
        worker = f"http://{LOOPBACK}:{http}"
        assert worker in router and f"{worker}=tcp://{LOOPBACK}:{events}" in router
        replica = services[name]
        assert f"tcp://0.0.0.0:{events}" in replica["command"] and replica["command"][-2:] == ["--executor", "fake"]
        assert option(replica["command"], "--http-port") == str(http) and "deploy" not in replica
        grpc = str(port_map[(name, 50051)])
        assert option(replica["command"], "--port") == grpc
        assert option(replica["healthcheck"]["test"], "--port") == grpc
    assert option(router, "--port") == str(port_map[("router", 8080)])
    assert services["router"]["healthcheck"]["test"][-1] == f"http://127.0.0.1:{port_map[('router', 8080)]}/readiness"
    assert [(p.host_ip, p.target) for p in services["router"]["ports"]] == [("127.0.0.1", port_map[("router", 8080)])]
    assert listens(compose["services"]["router"]["command"]) == {"http": 8080, "metrics": 29000}
    with pytest.raises(ComposeError, match="two services listen on"):
        localize(compose, tmp_path, executor="fake")  # one port map by container port cannot say whose 8000


def _broken(edit) -> list[str]:
    compose = load_replicas()
    edit(compose["services"])
    return check_compose(compose)


def _replace(command: list[str], old: str, new: str) -> None:
    command[command.index(old)] = new


def _drop_option(command: list[str], flag: str) -> None:
    del command[command.index(flag) : command.index(flag) + 2]


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda s: s["router"]["ports"].__setitem__(0, "8080:8080"), "vllm-router checks no token"),
        (lambda s: s["replica-a"].__setitem__("ports", ["8000:8000"]), "published on 0.0.0.0"),
        (lambda s: _drop_option(s["replica-b"]["command"], "--allowed-hosts"), "replica-b refuses the router's"),
        (lambda s: _replace(s["router"]["command"], "http://replica-a:8000", "http://replica-a:8001"), "serves HTTP"),
        (lambda s: _replace(s["router"]["command"], "http://replica-b:8000", "http://replica-c:8000"), "names no"),
        (
            lambda s: _replace(
                s["router"]["command"],
                "http://replica-a:8000=tcp://replica-a:5557",
                "http://replica-a:8000=tcp://replica-a:5558",
            ),
            "publishes KV events on 5557",
        ),
        (lambda s: s["router"]["depends_on"].pop("replica-b"), "does not depend_on replica-b"),
        (lambda s: s["router"].__setitem__("networks", ["elsewhere"]), "shares no network"),
        (lambda s: _replace(s["replica-a"]["healthcheck"]["test"], "50051", "50061"), "probes port 50061"),
        (lambda s: s["replica-a"]["command"].remove("--allow-insecure-remote"), "would exit: refusing"),
    ],
)
def test_the_checker_catches_a_broken_copy(edit, expected: str) -> None:
    problems = _broken(edit)
    assert any(expected in p for p in problems), problems
