"""Disconnect storm: 300 streams; the client processes holding a random third are SIGKILLed
mid-stream (no cancel call). Every dropped request is aborted, every block comes back, and
the 200 surviving streams get exactly what they get without the storm."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time

import pytest

from kvserve.protos.kvserve.v1 import api_pb2_grpc
from kvserve.testing.stream_requests import collect, greedy_request

pytestmark = pytest.mark.timeout(180)

NUM_STREAMS = 300
NUM_DROPPED = NUM_STREAMS // 3
STREAMS_PER_PROCESS = 10
SURVIVOR_TOKENS = 60


def _start_droppers(address: str, keys: list[int]) -> list[subprocess.Popen]:
    groups = [keys[i : i + STREAMS_PER_PROCESS] for i in range(0, len(keys), STREAMS_PER_PROCESS)]
    return [
        subprocess.Popen(
            [sys.executable, "-m", "tests.reliability.dropping_client", address, *map(str, group)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for group in groups
    ]


def _wait_ready(process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    line = process.stdout.readline()  # blocks until READY (or EOF when it died)
    assert line.strip() == "READY" and time.monotonic() < deadline, f"dropping client failed: {line!r}"


def test_300_streams_with_a_third_dropped_leak_nothing_and_survivors_are_unchanged(serve) -> None:
    rng = random.Random(1234)
    server = serve(["--executor", "fake", "--num-blocks", "8192", "--step-latency-ms", "10"])
    dropped = sorted(rng.sample(range(NUM_STREAMS), NUM_DROPPED))
    survivors = [k for k in range(NUM_STREAMS) if k not in set(dropped)]
    requests = [greedy_request(k, SURVIVOR_TOKENS) for k in survivors]

    async def run_survivors(during_storm: list[subprocess.Popen] | None) -> list:
        async with server.aio_channel() as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            tasks = [asyncio.create_task(collect(stub, r)) for r in requests]
            if during_storm:
                delays = sorted(rng.uniform(0.0, 1.0) for _ in during_storm)
                started = time.monotonic()
                for process, delay in zip(during_storm, delays):
                    await asyncio.sleep(max(0.0, started + delay - time.monotonic()))
                    process.send_signal(signal.SIGKILL)
            return await asyncio.gather(*tasks)

    undisturbed = asyncio.run(run_survivors(None))
    assert all(len(ids) == SURVIVOR_TOKENS for ids, _ in undisturbed)
    droppers = _start_droppers(server.address, dropped)
    try:
        for process in droppers:
            _wait_ready(process)
        assert server.stats().requests_running + server.stats().requests_waiting >= NUM_DROPPED
        disturbed = asyncio.run(run_survivors(droppers))
    finally:
        for process in droppers:
            process.kill()
            process.wait(10)
    assert [ids for ids, _ in disturbed] == [ids for ids, _ in undisturbed]
    stats = server.wait_idle(timeout_s=30)
    assert stats.blocks_referenced == 0, stats
    assert stats.requests_running == 0 and stats.requests_waiting == 0 and stats.requests_swapped == 0
    assert stats.blocks_free + stats.blocks_cached == stats.num_blocks
    aborted = [e for e in server.log_events("request_finished") if e.get("finish_reason") == "abort"]
    assert len(aborted) == NUM_DROPPED
    assert server.process.poll() is None
