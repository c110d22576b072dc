"""The web page's routes over a real `kvserve serve`: the page, its headers, and the engine-view stream.

The stream's bound is checked under load: a fake-executor server with 2,000 blocks and 200
requests in flight keeps each update under `UI_MAX_EVENT_BYTES`, and sends no more than one
update per interval, by the server's clock (an upper bound, so a slow machine cannot fail it).
"""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import pytest

from kvserve.config import defaults
from kvserve.testing.server_launcher import ServeProcess
from tests.http.http_clients import ALICE, FAKE_ARGS, async_sdk, token_file

pytestmark = pytest.mark.timeout(240)

LOADED = ["--executor", "fake", "--num-blocks", "2000", "--step-latency-ms", "5", "--ui-interval", "0.25"]


def _events(server: ServeProcess, count: int, headers: dict | None = None) -> list[bytes]:
    """The first `count` engine-view updates."""
    got: list[bytes] = []
    with httpx.stream("GET", f"{server.http_url}/ui/events", headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                got.append(line[len("data: ") :].encode())
                if len(got) == count:
                    break
    return got


def test_the_page_and_its_assets_are_served_with_a_strict_policy(http_server: ServeProcess) -> None:
    page = httpx.get(http_server.http_url + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<main id="chat"' in page.text and '<aside id="engine"' in page.text
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert page.headers["x-frame-options"] == "DENY"
    assert "access-control-allow-origin" not in page.headers, "no CORS unless --cors-origin names an origin"
    for asset, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        response = httpx.get(f"{http_server.http_url}/ui/{asset}", timeout=30)
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
    missing = httpx.get(f"{http_server.http_url}/ui/../pyproject.toml", timeout=30)
    assert missing.status_code == 404
    assert httpx.get(f"{http_server.http_url}/ui/config", timeout=30).json() == {
        "auth": False,
        "stream_interval_s": defaults.UI_INTERVAL_S,
    }


def test_under_200_requests_on_2000_blocks_each_update_stays_bounded(http_serve_factory) -> None:
    server = http_serve_factory(LOADED)
    client = async_sdk(server)
    prompts = [f"Request {i}: " + "tell me about the sea " * (2 + i % 9) for i in range(200)]

    async def one(prompt: str) -> None:
        await client.chat.completions.create(
            model="fake:smollm2-135m-instruct",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=64,
            extra_body={"ignore_eos": True},
        )

    async def watch_under_load() -> list[bytes]:
        """Every update from before the load starts until after it ends."""
        updates: list[bytes] = []
        loaded = asyncio.Event()
        async with (
            httpx.AsyncClient(base_url=server.http_url, timeout=120) as http,
            http.stream("GET", "/ui/events") as response,
        ):
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            load: asyncio.Future | None = None
            after = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                updates.append(line[len("data: ") :].encode())
                if load is None:  # the viewer is attached: now the load
                    load = asyncio.gather(*(one(p) for p in prompts))
                    load.add_done_callback(lambda _: loaded.set())
                after += loaded.is_set()
                if after >= 2:
                    break
            assert load is not None
            await load
        return updates

    updates = asyncio.run(watch_under_load())
    sizes = [len(data) for data in updates]
    assert max(sizes) <= defaults.UI_MAX_EVENT_BYTES, max(sizes)
    snapshots = [json.loads(data) for data in updates]
    busiest = max(snapshots, key=lambda s: s["queues"]["running"] + s["queues"]["waiting"])
    assert busiest["queues"]["running"] + busiest["queues"]["waiting"] > 50, "the stream was watched under load"
    assert busiest["pool"]["num_blocks"] == 2000 and len(busiest["pool"]["cells"]) == 2000
    assert all(len(s["pool"]["owners"]) <= defaults.UI_MAX_OWNERS for s in snapshots)
    # The rate, by the server's own clock (a busy client may read several updates at once):
    # consecutive updates are at least one interval apart.
    times = [s["time"] for s in snapshots]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 0.25 * 0.95, gaps


def test_no_ui_removes_the_page_and_the_stream(http_serve_factory) -> None:
    server = http_serve_factory([*FAKE_ARGS, "--no-ui"])
    for path in ("/", "/ui/events", "/ui/config", "/ui/app.js"):
        assert httpx.get(server.http_url + path, timeout=30).status_code == 404, path
    assert httpx.get(server.http_url + "/health", timeout=30).status_code == 200


def test_with_auth_the_page_is_open_and_the_stream_needs_a_token(http_serve_factory, tmp_path) -> None:
    server = http_serve_factory([*FAKE_ARGS, "--auth-token-file", str(token_file(tmp_path))])
    assert httpx.get(server.http_url + "/", timeout=30).status_code == 200
    assert httpx.get(server.http_url + "/ui/config", timeout=30).json()["auth"] is True
    refused = httpx.get(server.http_url + "/ui/events", timeout=30)
    assert refused.status_code == 401 and "bearer" in refused.json()["error"]["message"]
    [data] = _events(server, 1, headers={"Authorization": f"Bearer {ALICE}"})
    assert json.loads(data)["viewer"] == {"tenant": "alice", "admin": False}


def test_bad_ui_options_are_refused_at_start(http_serve_factory) -> None:
    for args, message in (
        (["--ui-interval", "0.01"], "--ui-interval must be at least"),
        (["--admin-tenant", "root"], "--admin-tenant needs --auth-token-file"),
    ):
        server = http_serve_factory([*FAKE_ARGS, *args], wait=False)
        assert server.process.wait(timeout=60) == 2
        assert message in server.log_text()
