"""`kvserve serve --data-parallel-size 2`: two fake-executor replicas behind the real vllm-router.

The kill -9 test streams 32 chat completions through the router with the official `openai`
SDK, kills one replica's scheduler with SIGKILL while they run, and then checks what a user
would: every stream ends (finished, or an error raised to the client, never a hang or a
silent truncation), requests sent once the router has taken the dead replica out of
rotation all succeed, and the replica comes back (restarted by the replica set, readmitted
by the router's health checks) and serves again. Served counts come from each replica's own
/metrics, not from anything the router says.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvserve.testing.ports import free_port
from kvserve.testing.replica_launcher import ReplicaSetProcess, metric_total, serving_replicas
from kvserve.testing.server_launcher import pid_alive
from kvserve.testing.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

STREAMS = 32
STREAM_TOKENS = 600
"""At the fake executor's 10 ms a step, a stream lasts 6 s or more: long enough to be killed mid-way,
even when a loaded machine forwards the 32 requests slowly."""
RESTART_BACKOFF_S = 20.0
"""The replica stays dead this long, so the router's 1 s health checks see it go, and the live replica's
streams end and the follow-up requests run while it is still down."""
START_TIMEOUT_S = 120.0


@pytest.fixture
def replica_set(tmp_path: Path) -> Iterator[ReplicaSetProcess]:
    args = ["--router-policy", "round_robin", "--executor", "fake", "--num-blocks", "4096"]
    args += ["--step-latency-ms", "10", "--replica-restart-backoff-s", str(RESTART_BACKOFF_S)]
    args += ["--router-args", "--health-check-interval-secs 1 --health-failure-threshold 1"]
    with serving_replicas(args, tmp_path, timeout_s=START_TIMEOUT_S) as replicas:
        yield replicas
        started = replicas.started_pids()
    wait_until(lambda: not [pid for pid in started if pid_alive(pid)], 30, "every process of the set to be gone")


def _served(replicas: ReplicaSetProcess, index: int) -> float:
    """Requests replica `index` finished, from its own /metrics."""
    return metric_total(replicas.replica_urls[index], "kvserve:request_success_total")


def test_sigterm_stops_every_process_and_exits_zero(replica_set: ReplicaSetProcess) -> None:
    pids = replica_set.started_pids()
    assert len(pids) >= 5, "two replicas, two executors and the router were started"
    replica_set.process.send_signal(signal.SIGTERM)
    assert replica_set.process.wait(60) == 0, replica_set.log_path.read_text()[-3000:]
    wait_until(lambda: not [pid for pid in pids if pid_alive(pid)], 30, "every child to be gone")


async def _stream(client: openai.AsyncOpenAI, model: str, i: int) -> str:
    """'finished', or 'error' when the SDK raised; a stream that just stops is 'truncated'."""
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Tell me a long story, number {i}."}],
            max_tokens=STREAM_TOKENS,
            stream=True,
        )
        finish = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return "finished" if finish == "length" else "truncated"
    except openai.APIError:
        return "error"


def _complete(url: str, model: str, i: int) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Question {i}?"}], max_tokens=4
    )
    assert reply.choices[0].finish_reason == "length"


def test_kill_9_of_a_replica_under_32_streams(replica_set: ReplicaSetProcess) -> None:
    victim = 1
    (victim_pid,) = replica_set.replica_pids(victim)
    before = [_served(replica_set, i) for i in range(2)]
    model = replica_set.model()

    async def run_streams() -> list[str]:
        client = openai.AsyncOpenAI(base_url=replica_set.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        tasks = [asyncio.create_task(_stream(client, model, i)) for i in range(STREAMS)]

        seen: list[list[int]] = []

        def victim_busy() -> bool:
            """The victim runs a quarter of the streams and the other replica has some too."""
            loads = replica_set.loads()
            if not seen or seen[-1] != loads:
                seen.append(loads)
            return loads[victim] >= STREAMS // 4 and loads[1 - victim] > 0

        def why() -> str:
            return f"streams on both replicas; loads seen {seen}, router workers {replica_set.workers()}:\n" + (
                replica_set.log_tail()
            )

        await asyncio.to_thread(wait_until, victim_busy, 60, why)
        os.kill(victim_pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), 180)

    outcomes = asyncio.run(run_streams())
    assert "truncated" not in outcomes, f"a stream ended without a finish reason or an error: {outcomes}"
    assert outcomes.count("error") >= STREAMS // 4, f"the dead replica's streams got an error: {outcomes}"
    assert outcomes.count("finished") >= STREAMS // 4, f"the live replica's streams finished: {outcomes}"
    assert _served(replica_set, 0) - before[0] == outcomes.count("finished")

    victim_url = replica_set.replica_urls[victim]
    wait_until(lambda: replica_set.workers().get(victim_url) is False, 30, "the router to take the replica out")
    assert len(replica_set.replica_pids(victim)) == 1, "the replica is still down (its restart back-off)"
    for i in range(8):
        _complete(replica_set.url, model, i)  # every one succeeds, on the replica that is left

    wait_until(lambda: len(replica_set.replica_pids(victim)) == 2, 60, "the replica set to restart the replica")
    wait_until(lambda: replica_set.workers().get(victim_url) is True, 120, "the replica to rejoin the rotation")
    for i in range(8):
        _complete(replica_set.url, model, 100 + i)
    assert _served(replica_set, victim) >= 3, "the restarted replica serves again (its counters start from zero)"
    assert replica_set.events("replica_rejoined"), "the replica set reported the rejoin"


def test_a_router_that_cannot_start_fails_the_start_up(tmp_path: Path) -> None:
    """A bad --router-args makes vllm-router exit at once: the set stops and says so, exit 1."""
    out = subprocess.run(
        [sys.executable, "-m", "kvserve", "serve", "-dp", "2", "--executor", "fake", "--port", "0"]
        + ["--http-port", str(free_port()), "--router-args=--no-such-router-flag"],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "the router exited with code" in out.stderr and "Traceback" not in out.stderr
