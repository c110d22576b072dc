"""Overload: past the queue limits new requests get RESOURCE_EXHAUSTED, saying which limit, and are
never queued; the running set stays bounded by max_num_seqs, and after the load every block is back.

How fast a rejection comes back is a performance figure: it belongs in a benchmark, not in a timed test.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvserve.protos.kvserve.v1 import api_pb2_grpc
from kvserve.testing.stream_requests import greedy_request
from kvserve.testing.waiting import wait_until_async

pytestmark = pytest.mark.timeout(120)

MAX_SEQS = 4
MAX_QUEUED = 8
QUEUED_WITHIN_S = 30.0
"""Bounds only a stuck server: the waits return once the requests are queued."""


async def _first_outcome(call) -> tuple[str, str]:
    """('ok', '') once a chunk arrives, else (the status code name, its details)."""
    try:
        await call.read()
        return "ok", ""
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details()


def test_queue_limit_rejects_and_everything_is_returned_afterwards(serve) -> None:
    server = serve(
        [
            "--executor",
            "fake",
            "--num-blocks",
            "1024",
            "--step-latency-ms",
            "20",
            "--max-num-seqs",
            str(MAX_SEQS),
            "--max-queued-requests",
            str(MAX_QUEUED),
        ]
    )

    async def scenario():
        async with server.aio_channel() as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            running = [stub.Generate(greedy_request(i, 4000), timeout=60) for i in range(MAX_SEQS)]
            for call in running:
                await call.read()
            queued = [stub.Generate(greedy_request(100 + i, 10), timeout=60) for i in range(MAX_QUEUED)]
            await wait_until_async(
                lambda: server.stats().requests_waiting >= MAX_QUEUED, QUEUED_WITHIN_S, f"{MAX_QUEUED} queued requests"
            )
            flood = [stub.Generate(greedy_request(200 + i, 10), timeout=60) for i in range(40)]
            outcomes = await asyncio.gather(*(_first_outcome(c) for c in flood))
            stats = server.stats()
            for call in running + queued:
                call.cancel()
            return outcomes, stats

    outcomes, stats = asyncio.run(scenario())
    assert len(outcomes) == 40
    assert outcomes == [("RESOURCE_EXHAUSTED", f"queue full: {MAX_QUEUED} requests are waiting; retry later")] * 40
    assert stats.requests_running == MAX_SEQS and stats.requests_waiting == MAX_QUEUED  # none of the 40 queued
    idle = server.wait_idle()
    assert idle.blocks_referenced == 0 and idle.blocks_free + idle.blocks_cached == idle.num_blocks


def test_queued_prompt_token_limit(serve) -> None:
    server = serve(
        [
            "--executor",
            "fake",
            "--num-blocks",
            "1024",
            "--step-latency-ms",
            "20",
            "--max-num-seqs",
            "1",
            "--max-queued-prompt-tokens",
            "100",
        ]
    )

    async def scenario():
        async with server.aio_channel() as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            blocker = stub.Generate(greedy_request(1, 4000), timeout=60)
            await blocker.read()
            fits = [stub.Generate(greedy_request(10 + i, 5, prompt_len=40), timeout=60) for i in range(2)]
            await wait_until_async(lambda: server.stats().requests_waiting >= 2, QUEUED_WITHIN_S, "2 queued requests")
            too_many = stub.Generate(greedy_request(20, 5, prompt_len=40), timeout=60)
            outcome = await _first_outcome(too_many)
            waiting = server.stats().requests_waiting
            blocker.cancel()
            finished = [[t async for t in call] for call in fits]  # the admitted ones still complete
            return outcome, waiting, finished

    (code, details), waiting, finished = asyncio.run(scenario())
    assert code == "RESOURCE_EXHAUSTED"
    assert details == "queue full: 80 prompt tokens are waiting; retry later"  # the 2 queued prompts of 40
    assert waiting == 2, "the rejected request was queued"
    assert all(sum(len(c.token_ids) for c in chunks) == 5 for chunks in finished)
    assert server.wait_idle().blocks_referenced == 0


def test_pressure_on_a_tiny_pool_preempts_and_still_completes_everything(serve) -> None:
    # 32 blocks = 512 tokens for 24 requests that need up to 96 tokens each: recompute preemption.
    server = serve(["--executor", "fake", "--num-blocks", "32", "--step-latency-ms", "2"])

    async def scenario():
        async with server.aio_channel() as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            calls = [stub.Generate(greedy_request(i, 64, prompt_len=32), timeout=90) for i in range(24)]
            return [[t for c in [chunk async for chunk in call] for t in c.token_ids] for call in calls]

    outputs = asyncio.run(scenario())
    assert all(len(ids) == 64 for ids in outputs)
    stats = server.wait_idle()
    assert stats.num_preemptions > 0 and stats.blocks_referenced == 0
