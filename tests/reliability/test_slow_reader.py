"""A client that stops reading must not stall anyone else, and loses nothing itself.

The engine never waits on a client: each stream has a bounded buffer (`--stream-buffer-chunks`)
and once it is full new tokens are merged into the newest buffered chunk. The slow reader
here asks for top-20 logprobs so its chunks are large enough to fill gRPC's flow-control
window, which is what makes the server side actually back up.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.testing.stream_requests import collect, greedy_request
from kvserve.testing.waiting import wait_until_async

pytestmark = pytest.mark.timeout(120)

SLOW_TOKENS = 800
FAST_STREAMS = 20
FAST_TOKENS = 100


def _slow_request() -> api_pb2.GenerateRequest:
    request = greedy_request(5, SLOW_TOKENS)
    request.sampling.logprobs = 20
    return request


def test_a_stalled_reader_does_not_slow_other_streams_and_gets_every_token(serve) -> None:
    server = serve(
        ["--executor", "fake", "--num-blocks", "2048", "--step-latency-ms", "3", "--stream-buffer-chunks", "8"]
    )
    fast = [greedy_request(100 + i, FAST_TOKENS) for i in range(FAST_STREAMS)]

    async def fast_streams(stub) -> tuple[list, float]:
        started = time.monotonic()
        results = await asyncio.gather(*(collect(stub, r) for r in fast))
        return results, time.monotonic() - started

    async def scenario():
        async with server.aio_channel() as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            alone, alone_s = await fast_streams(stub)
            reference = [c async for c in stub.Generate(_slow_request(), timeout=60)]
            # Without BDP probing the receive window stays at 64 KiB, so the server backs up soon.
            slow_channel = grpc.aio.insecure_channel(server.address, options=[("grpc.http2.bdp_probe", 0)])
            slow = api_pb2_grpc.KVServeStub(slow_channel).Generate(_slow_request(), timeout=60)
            await slow.read()  # then stop reading while it generates
            beside, beside_s = await fast_streams(stub)
            # The slow request finishes generating, unread: the engine never waited for its reader.
            finished = await wait_until_async(
                lambda: (stats := server.stats()).requests_running == 0 and stats,
                30.0,
                "the unread slow request to finish generating",
                interval_s=0.05,
            )
            assert finished.requests_waiting == 0 and not slow.done()
            rest = []
            while (chunk := await slow.read()) is not grpc.aio.EOF:
                rest.append(chunk)
            await slow_channel.close()
            return alone, alone_s, beside, beside_s, reference, rest

    alone, alone_s, beside, beside_s, reference, rest = asyncio.run(scenario())
    # Every fast stream ran to its end, token for token as alone, while the slow reader took nothing
    # after its first chunk: nothing waited on it (how long they took is a benchmark's business).
    assert beside == alone
    assert all(len(ids) == FAST_TOKENS and reason == api_pb2.FINISH_REASON_LENGTH for ids, reason in beside)
    ref_tokens = [t for c in reference for t in c.token_ids]
    got_tokens = [t for c in rest for t in c.token_ids]
    assert len(ref_tokens) == SLOW_TOKENS
    assert got_tokens == ref_tokens[len(ref_tokens) - len(got_tokens) :]
    assert len(got_tokens) >= SLOW_TOKENS - 1  # only the first chunk was read before the stall
    assert [lp.token_id for c in rest for lp in c.logprobs] == got_tokens
    assert len(rest) < len(got_tokens), "a full buffer must merge chunks instead of growing"
    assert rest[-1].finish_reason == api_pb2.FINISH_REASON_LENGTH
    assert rest[-1].usage.completion_tokens == SLOW_TOKENS
    print(
        f"MEASURED slow reader: {len(got_tokens)} tokens arrived in {len(rest)} chunks; "
        f"20 fast streams took {beside_s:.2f}s beside it vs {alone_s:.2f}s alone"
    )
