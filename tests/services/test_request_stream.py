from __future__ import annotations

import asyncio

import pytest

from kvserve.protos.stop_rules import FinishReason
from kvserve.scheduler.server.delivery.request_stream import CompletionChunk, FailureKind, RequestFailed, RequestStream


def test_slow_reader_gets_merged_chunks_and_loses_nothing() -> None:
    async def scenario() -> list[CompletionChunk]:
        stream = RequestStream("r", max_chunks=4)
        for k in range(100):
            stream.put(CompletionChunk(index=k % 2, token_ids=[k], text=f"<{k}>"))
        stream.put(CompletionChunk(index=0, token_ids=[], text="", finish_reason=FinishReason.LENGTH))
        stream.close()
        return [chunk async for chunk in stream]

    chunks = asyncio.run(scenario())
    assert len(chunks) <= 6
    for index in (0, 1):
        mine = [c for c in chunks if c.index == index]
        assert [t for c in mine for t in c.token_ids] == list(range(index, 100, 2))
        assert "".join(c.text for c in mine) == "".join(f"<{k}>" for k in range(index, 100, 2))
    assert chunks[-1].finish_reason is FinishReason.LENGTH or any(c.finish_reason for c in chunks)


def test_failure_is_raised_after_buffered_chunks() -> None:
    async def scenario() -> list[str]:
        stream = RequestStream("r", max_chunks=8)
        stream.put(CompletionChunk(index=0, token_ids=[1], text="a"))
        stream.fail(RequestFailed(FailureKind.UNAVAILABLE, "gone"))
        seen = []
        with pytest.raises(RequestFailed) as info:
            async for chunk in stream:
                seen.append(chunk.text)
        assert info.value.kind is FailureKind.UNAVAILABLE
        return seen

    assert asyncio.run(scenario()) == ["a"]


def test_reader_waits_for_chunks() -> None:
    async def scenario() -> list[str]:
        stream = RequestStream("r", max_chunks=8)

        async def produce() -> None:
            for k in range(3):
                await asyncio.sleep(0.01)
                stream.put(CompletionChunk(index=0, token_ids=[k], text=str(k)))
            stream.close()

        task = asyncio.create_task(produce())
        out = [c.text async for c in stream]
        await task
        return out

    assert asyncio.run(scenario()) == ["0", "1", "2"]


def test_backlog_of_one_completion_is_read_as_one_chunk_but_finish_stays_last() -> None:
    async def scenario() -> list[CompletionChunk]:
        stream = RequestStream("r", max_chunks=64)
        for k in range(5):
            stream.put(CompletionChunk(index=0, token_ids=[k], text=str(k)))
        stream.put(CompletionChunk(index=1, token_ids=[9], text="x", finish_reason=FinishReason.LENGTH))
        stream.put(CompletionChunk(index=0, token_ids=[5], text="5", finish_reason=FinishReason.LENGTH))
        stream.close()
        return [chunk async for chunk in stream]

    chunks = asyncio.run(scenario())
    assert [(c.index, c.token_ids, c.text, c.finish_reason) for c in chunks] == [
        (0, [0, 1, 2, 3, 4], "01234", None),
        (1, [9], "x", FinishReason.LENGTH),
        (0, [5], "5", FinishReason.LENGTH),
    ]
