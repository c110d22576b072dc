"""The HTTP API through the server's life: readiness across an executor kill, disconnects, load, drain."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import openai
import pytest

from kvserve.scheduler.server.http.readiness import PROBE_TENANT
from kvserve.testing.replica_launcher import metric_total
from kvserve.testing.server_launcher import ServeProcess
from kvserve.testing.waiting import wait_until
from tests.http.http_clients import FAKE_ARGS, sdk, wait_for_status

LONG = 6000
"""max_tokens no test waits for: a request that ends must have been aborted."""


def finished_event(server: ServeProcess, user: str, timeout_s: float = 60.0) -> dict:
    """The `request_finished` log line of the HTTP request sent with `user`."""

    def logged() -> dict | None:
        ids = {e["request_id"] for e in server.log_events("http_request") if e.get("user") == user}
        for event in server.log_events("request_finished"):
            if event["request_id"] in ids or any(event["request_id"].startswith(f"{i}-") for i in ids):
                return event
        return None

    return wait_until(logged, timeout_s, f"a request_finished line for user {user!r}", interval_s=0.05)


def test_ready_follows_the_executor_and_health_stays_up(http_serve_factory) -> None:
    server = http_serve_factory(FAKE_ARGS)
    wait_for_status(f"{server.http_url}/ready", 200, 60)
    probes = [e for e in server.log_events("request_finished") if e["request_id"].startswith(f"{PROBE_TENANT}/")]
    assert probes, "an idle server's /ready ran a probe request"
    # A probe is not a client's request: a router's health checks must not add served requests.
    assert metric_total(server.http_url, "kvserve:request_success_total") == 0
    victim = server.executor_pids()[-1]
    os.kill(victim, signal.SIGKILL)
    not_ready = wait_for_status(f"{server.http_url}/ready", 503, 60)
    assert not_ready.json()["error"]["code"] == "not_ready", not_ready.text
    assert httpx.get(f"{server.http_url}/health").status_code == 200  # liveness: the process runs
    wait_for_status(f"{server.http_url}/ready", 200, 120)
    assert server.executor_pids()[-1] != victim
    answer = httpx.post(f"{server.http_url}/v1/completions", json={"prompt": "back", "max_tokens": 2}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert metric_total(server.http_url, "kvserve:request_success_total") == 1


def test_stream_disconnect_aborts_and_returns_its_blocks(http_server: ServeProcess) -> None:
    body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": LONG, "stream": True, "user": "sse-gone"}
    with httpx.stream("POST", f"{http_server.http_url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        contents = 0
        while contents < 3:
            contents += '"delta":{"content":' in next(lines)
    # Leaving the block closed the connection mid-stream.
    assert finished_event(http_server, "sse-gone")["finish_reason"] == "abort"
    stats = http_server.wait_idle(timeout_s=60)
    assert stats.blocks_referenced == 0 and stats.requests_running == 0 and stats.requests_waiting == 0


def test_non_streaming_disconnect_aborts_too(http_server: ServeProcess) -> None:
    body = {"prompt": "and so on", "max_tokens": LONG, "n": 2, "user": "full-gone"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{http_server.http_url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    assert finished_event(http_server, "full-gone")["finish_reason"] == "abort"
    assert http_server.wait_idle(timeout_s=60).blocks_referenced == 0


def test_200_concurrent_streams_complete(http_server: ServeProcess) -> None:
    async def one(client: httpx.AsyncClient, k: int) -> tuple[str, str | None, bool]:
        body = {"prompt": f"stream number {k}", "max_tokens": 8, "temperature": 0, "stream": True}
        text, finish, done = "", None, False
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    choice = json.loads(line.removeprefix("data: "))["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
        return text, finish, done

    async def scenario() -> list[tuple[str, str | None, bool]]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(base_url=http_server.http_url, limits=limits, timeout=300) as client:
            return await asyncio.gather(*(one(client, k) for k in range(200)))

    results = asyncio.run(scenario())
    assert all(done and finish == "length" and text for text, finish, done in results)
    assert http_server.wait_idle(timeout_s=60).blocks_referenced == 0


def test_sigterm_drains_an_http_stream_then_exits(http_serve_factory) -> None:
    server = http_serve_factory(FAKE_ARGS[:-2] + ["--step-latency-ms", "20"])
    body = {"prompt": "drain me", "max_tokens": 40, "stream": True}
    with httpx.stream("POST", f"{server.http_url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        server.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    finishes = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in rest if x.startswith("data: {")]
    assert finishes[-1] == "length"  # it finished within the drain grace, not aborted
    assert server.process.wait(60) == 0
    assert server.log_events("draining")


def test_a_failure_mid_stream_is_an_error_event_the_sdk_raises(http_serve_factory) -> None:
    args = [*FAKE_ARGS[:-2], "--step-latency-ms", "20", "--no-executor-restart", "--executor-restart-timeout", "1"]
    server = http_serve_factory(args)
    client = sdk(server)
    stream = client.chat.completions.create(
        model="fake:smollm2-135m-instruct", messages=[{"role": "user", "content": "go"}], max_tokens=LONG, stream=True
    )
    killed = False
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            if not killed and chunk.choices and chunk.choices[0].delta.content:
                os.kill(server.executor_pids()[-1], signal.SIGKILL)
                killed = True
    assert "did not come back" in info.value.message
    refused = httpx.post(f"{server.http_url}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(f"{server.http_url}/ready", timeout=30).status_code == 503


def test_a_taken_http_port_is_one_clear_error(tmp_path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "kvserve", "serve", "--executor", "fake", "--port", "0", "--http-port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
    assert result.returncode == 2, result.stderr
    assert f"kvserve: HTTP API: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr and "executor_started" not in result.stderr
