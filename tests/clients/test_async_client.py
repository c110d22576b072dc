"""The asyncio client against the scripted in-process gRPC server."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvserve.clients import AsyncClient, KVServeError


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
    async def main():
        async with AsyncClient(scripted_server.target) as client:
            received = 0
            async for _ in client.stream("slow: go", max_tokens=10_000):
                received += 1
                if received == 2:
                    break
            # The stream object is dropped here; its RPC must be cancelled without closing the client.
            for _ in range(100):
                if scripted_server.servicer.recorded.cancelled.is_set():
                    return True
                await asyncio.sleep(0.05)
            return False

    assert run(main()), "server never saw the cancellation"


def test_cancelling_the_task_cancels_the_rpc(scripted_server) -> None:
    async def consume(client):
        async for _ in client.stream("slow: go", max_tokens=10_000):
            pass

    async def main():
        async with AsyncClient(scripted_server.target) as client:
            task = asyncio.create_task(consume(client))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                if scripted_server.servicer.recorded.cancelled.is_set():
                    return True
                await asyncio.sleep(0.05)
            return False

    assert run(main())


def test_explicit_cancel_stops_iteration(scripted_server) -> None:
    async def main():
        async with AsyncClient(scripted_server.target) as client:
            stream = client.stream("slow: go", max_tokens=10_000)
            first = await stream.__anext__()
            stream.cancel()
            rest = [c async for c in stream]
            return first, rest

    first, rest = run(main())
    assert first.token_ids == [1000] and rest == []
    assert scripted_server.servicer.recorded.cancelled.wait(5)


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

            async def consume():
                return [c async for c in stream]

            consumer = asyncio.create_task(consume())
            await asyncio.sleep(0.2)
            stream.cancel()
            return await asyncio.wait_for(consumer, 5)

    received = run(main())
    assert 1 <= len(received) < 100
    assert scripted_server.servicer.recorded.cancelled.wait(5)
