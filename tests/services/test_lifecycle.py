"""Process lifecycle of `kvserve serve`: SIGTERM drain, executor restart, executor never coming back."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.testing.server_launcher import pid_alive
from kvserve.testing.waiting import wait_until, wait_until_async

pytestmark = pytest.mark.timeout(300)

EVENT_TIMEOUT_S = 30.0
"""Bounds only a stuck server: every wait returns once its event happens."""


def _request(seed: int, max_tokens: int) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(
        token_ids=api_pb2.TokenIds(ids=[100 + seed, 200 + seed, 300 + seed, 17, 18, 19]),
        sampling=api_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


async def _tokens(stub, request, first_chunk: asyncio.Event | None = None) -> tuple[list[int], int]:
    """(token ids, finish reason) of a whole stream; `first_chunk` is set once its first tokens arrive."""
    ids, reason = [], 0
    async for chunk in stub.Generate(request, timeout=120):
        ids.extend(chunk.token_ids)
        reason = chunk.finish_reason or reason
        if first_chunk is not None:
            first_chunk.set()
    return ids, reason


async def _mid_stream(tasks: list[asyncio.Task], first_chunk: asyncio.Event) -> None:
    """Return once some stream has its first tokens, having checked that none has ended yet."""
    await asyncio.wait_for(first_chunk.wait(), EVENT_TIMEOUT_S)
    assert not any(t.done() for t in tasks), "a stream ended before the fault: it would not be mid-stream"


def test_sigterm_drains_in_flight_requests_then_exits(serve_factory) -> None:
    server = serve_factory(
        ["--executor", "fake", "--num-blocks", "512", "--step-latency-ms", "20", "--drain-grace-s", "20"]
    )
    executor_pid = server.executor_pids()[0]

    async def scenario():
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            call = stub.Generate(_request(1, 60), timeout=60)
            first = await call.read()
            server.process.terminate()
            # The drain starts at once; the timeout only bounds a stuck server.
            (health,) = await wait_until_async(
                lambda: (h,) if (h := server.health()) != health_pb2.HealthCheckResponse.SERVING else None,
                EVENT_TIMEOUT_S,
                "health to leave SERVING after SIGTERM",
            )
            assert health in (health_pb2.HealthCheckResponse.NOT_SERVING, None)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _tokens(stub, _request(2, 5))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            chunks = [first]
            while (chunk := await call.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
            return chunks

    chunks = asyncio.run(scenario())
    assert sum(len(c.token_ids) for c in chunks) == 60
    assert chunks[-1].finish_reason == api_pb2.FINISH_REASON_LENGTH
    assert server.process.wait(30) == 0
    wait_until(lambda: not pid_alive(executor_pid), EVENT_TIMEOUT_S, "the executor to exit with kvserve serve")


def test_killed_executor_is_restarted_and_streams_complete_unchanged(serve_factory) -> None:
    args = ["--executor", "fake", "--num-blocks", "1024", "--step-latency-ms", "10"]
    server = serve_factory(args)
    requests = [_request(i, 80) for i in range(20)]

    async def run_all(kill: bool):
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            first_chunk = asyncio.Event()
            tasks = [asyncio.create_task(_tokens(stub, r, first_chunk)) for r in requests]
            if kill:
                await _mid_stream(tasks, first_chunk)
                os.kill(server.executor_pids()[-1], 9)
            return await asyncio.gather(*tasks)

    undisturbed = asyncio.run(run_all(kill=False))
    disturbed = asyncio.run(run_all(kill=True))
    assert [ids for ids, _ in disturbed] == [ids for ids, _ in undisturbed]
    assert all(len(ids) == 80 and reason == api_pb2.FINISH_REASON_LENGTH for ids, reason in disturbed)
    stats = server.stats()
    assert stats.executor_restarts == 1
    assert stats.blocks_referenced == 0
    assert stats.executor_state == api_pb2.EXECUTOR_STATE_READY
    assert len(server.executor_pids()) == 2


def test_executor_that_never_returns_fails_requests_unavailable(serve_factory) -> None:
    server = serve_factory(
        [
            "--executor",
            "fake",
            "--num-blocks",
            "512",
            "--step-latency-ms",
            "10",
            "--no-executor-restart",
            "--executor-restart-timeout",
            "2",
        ]
    )

    async def scenario():
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            first_chunk = asyncio.Event()
            tasks = [asyncio.create_task(_tokens(stub, _request(i, 2000), first_chunk)) for i in range(5)]
            await _mid_stream(tasks, first_chunk)
            os.kill(server.executor_pids()[-1], 9)
            started = time.monotonic()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return results, time.monotonic() - started

    results, elapsed = asyncio.run(scenario())
    assert all(isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.UNAVAILABLE for r in results)
    assert "did not come back" in results[0].details()
    assert elapsed < 2 + 2 + 3  # detection (dead_after 2 s) + restart timeout + slack
    assert server.process.poll() is None  # the scheduler survives
    stats = server.stats()
    assert stats.blocks_referenced == 0
    assert stats.executor_state == api_pb2.EXECUTOR_STATE_LOST


def test_hung_executor_is_replaced_and_streams_complete(serve_factory) -> None:
    server = serve_factory(
        ["--executor", "fake", "--num-blocks", "1024", "--step-latency-ms", "10", "--executor-dead-after-s", "1"]
    )
    requests = [_request(i, 60) for i in range(8)]

    async def run_all(hang: bool):
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            first_chunk = asyncio.Event()
            tasks = [asyncio.create_task(_tokens(stub, r, first_chunk)) for r in requests]
            if hang:
                await _mid_stream(tasks, first_chunk)
                os.kill(server.executor_pids()[-1], 19)  # SIGSTOP: alive, silent
            return await asyncio.gather(*tasks)

    undisturbed = asyncio.run(run_all(hang=False))
    started = time.monotonic()
    disturbed = asyncio.run(run_all(hang=True))
    assert [ids for ids, _ in disturbed] == [ids for ids, _ in undisturbed]
    assert time.monotonic() - started < 30
    hung_pid = server.executor_pids()[0]
    assert not pid_alive(hung_pid)
    assert server.stats().executor_restarts == 1 and server.stats().blocks_referenced == 0
