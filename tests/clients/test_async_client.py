"""The asyncio client against the scripted in-process gRPC server."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvserve.clients import AsyncClient, KVServeError
from kvserve.testing.waiting import wait_until_async

EVENT_TIMEOUT_S = 10.0
"""Bounds only a stuck client or server: every wait returns once its event happens."""


def run(coro):
    return asyncio.run(coro)


def test_stream_and_generate(scripted_server) -> None:
    async def main():
        async with AsyncClient(scripted_server.target, token="tok") as client:
            chunks = [c async for c in client.stream(messages=[{"role": "user", "content": "hi"}], max_tokens=3)]
            completion = await client.generate("p q", n=2, max_tokens=2, request_id="mine")
        return chunks, completion

    chunks, completion = run(main())
    assert "".join(c.text for c in chunks) == " w0 w1 w2"
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.prompt_tokens == 7
    assert completion.request_id == "mine"
    assert [c.text for c in completion.choices] == [" w0 w1", " w0 w1"]
    assert [c.token_ids for c in completion.choices] == [[1000, 1001], [1100, 1101]]
    recorded = scripted_server.servicer.recorded
    assert recorded.requests[0].WhichOneof("prompt") == "chat"
    assert all(m["authorization"] == "Bearer tok" for m in recorded.metadata)


def test_breaking_out_cancels_server_stream(scripted_server) -> None:
    recorded = scripted_server.servicer.recorded

    async def main():
        async with AsyncClient(scripted_server.target) as client:
            received = 0
            async for _ in client.stream("slow: go", max_tokens=10_000):
                received += 1
                if received == 2:
                    break
            # The stream object is dropped here; its RPC must be cancelled without closing the client.
            await wait_until_async(recorded.cancelled.is_set, EVENT_TIMEOUT_S, "the server to see the cancellation")

    run(main())
    assert len(recorded.cancelled_ids) == 1 and len(recorded.requests) == 1, recorded.cancelled_ids


def test_cancelling_the_task_cancels_the_rpc(scripted_server) -> None:
    recorded = scripted_server.servicer.recorded
    received: list = []

    async def consume(client):
        async for chunk in client.stream("slow: go", max_tokens=10_000):
            received.append(chunk)

    async def main():
        async with AsyncClient(scripted_server.target) as client:
            task = asyncio.create_task(consume(client))
            await wait_until_async(lambda: received, EVENT_TIMEOUT_S, "the first chunk")
            assert not task.done(), "the stream ended before the cancel: it would not be mid-stream"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_until_async(recorded.cancelled.is_set, EVENT_TIMEOUT_S, "the server to see the cancellation")

    run(main())
    assert len(recorded.cancelled_ids) == 1 and len(recorded.requests) == 1, recorded.cancelled_ids


def test_explicit_cancel_stops_iteration(scripted_server) -> None:
    async def main():
        async with AsyncClient(scripted_server.target) as client:
            stream = client.stream("slow: go", max_tokens=10_000)
            first = await stream.__anext__()
            stream.cancel()
            rest = [c async for c in stream]
            return first, rest

    recorded = scripted_server.servicer.recorded
    first, rest = run(main())
    assert first.token_ids == [1000] and rest == []
    assert recorded.cancelled.wait(EVENT_TIMEOUT_S)
    assert len(recorded.cancelled_ids) == 1 and len(recorded.requests) == 1, recorded.cancelled_ids


def test_deadline_and_errors(scripted_server) -> None:
    async def main():
        async with AsyncClient(scripted_server.target, timeout_s=0.3) as client:
            with pytest.raises(KVServeError) as deadline:
                await client.generate("stall: zzz")
            with pytest.raises(KVServeError) as invalid:
                await client.generate("error:INVALID_ARGUMENT:n: must be in [1, 16], got 99")
        return deadline.value, invalid.value

    deadline, invalid = run(main())
    assert deadline.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert invalid.code is grpc.StatusCode.INVALID_ARGUMENT and invalid.details == "n: must be in [1, 16], got 99"


def test_unary_calls_and_health(scripted_server) -> None:
    async def main():
        async with AsyncClient(scripted_server.target) as client:
            await client.wait_until_serving(timeout_s=5)
            return (
                await client.abort("req-1"),
                await client.tokenize("a bb"),
                await client.model_info(),
                await client.server_stats(),
                await client.health(),
            )

    found, ids, info, stats, health = run(main())
    assert found is True and ids == [1, 2]
    assert info["block_size"] == 16 and stats["prefix_hit_tokens"] == 40 and health == "SERVING"


def test_wait_until_serving_times_out_on_unreachable_server() -> None:
    async def main():
        async with AsyncClient("127.0.0.1:1") as client:
            await client.wait_until_serving(timeout_s=0.5)

    with pytest.raises(KVServeError) as info:
        run(main())
    assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED


def test_cancel_from_another_task_ends_a_pending_read_quietly(scripted_server) -> None:
    async def main():
        async with AsyncClient(scripted_server.target) as client:
            stream = client.stream("slow: go", max_tokens=10_000)
            received: list = []

            async def consume():
                async for chunk in stream:
                    received.append(chunk)
                return received

            consumer = asyncio.create_task(consume())
            await wait_until_async(lambda: received, EVENT_TIMEOUT_S, "the first chunk")
            assert not consumer.done(), "the stream ended before the cancel: it would not be mid-stream"
            stream.cancel()
            return await asyncio.wait_for(consumer, EVENT_TIMEOUT_S)

    recorded = scripted_server.servicer.recorded
    received = run(main())
    assert 1 <= len(received) < 100
    assert recorded.cancelled.wait(EVENT_TIMEOUT_S)
    assert len(recorded.cancelled_ids) == 1 and len(recorded.requests) == 1, recorded.cancelled_ids
