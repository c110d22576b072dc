"""The `request_finished` JSON log line of `kvserve serve --executor fake` carries the request's block counts.

`blocks_hit` (reused at admission), `blocks_allocated` (taken from the pool), `blocks_copied`
(partial-block and copy-on-write copies) and `blocks_freed` (references dropped) add up: every
reference a request took it gave back, so allocated + hit - copied == freed.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.testing.server_launcher import ServeProcess
from kvserve.testing.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

BLOCK_FIELDS = ("blocks_hit", "blocks_allocated", "blocks_copied", "blocks_freed")
SHARED = list(range(300, 400))  # 100 tokens: full blocks for any block size up to 64
FORKED = list(range(500, 550))  # 50 tokens: the fork's last prompt token sits mid-block (copy-on-write)


def _request(request_id: str, ids: list[int], max_tokens: int, n: int = 1) -> api_pb2.GenerateRequest:
    sampling = api_pb2.SamplingParams(temperature=1.0, seed=3, max_tokens=max_tokens, ignore_eos=True, n=n)
    return api_pb2.GenerateRequest(request_id=request_id, token_ids=api_pb2.TokenIds(ids=ids), sampling=sampling)


def _finished_lines(server: ServeProcess, request_ids: set[str], timeout_s: float = 30.0) -> dict[str, dict]:
    """request id (as the client sent it) -> its one request_finished line, waiting for all of them."""

    def all_logged() -> dict[str, dict] | None:
        lines: dict[str, dict] = {}
        for event in server.log_events("request_finished"):
            client_id = event["request_id"].rsplit("/", 1)[-1]
            if client_id in request_ids:
                assert client_id not in lines, f"two request_finished lines for {client_id}"
                lines[client_id] = event
        return lines if set(lines) == request_ids else None

    return wait_until(all_logged, timeout_s, f"request_finished lines for {sorted(request_ids)}", interval_s=0.05)


def test_request_finished_reports_consistent_block_counts(serve_factory) -> None:
    server = serve_factory(["--executor", "fake", "--num-blocks", "512", "--step-latency-ms", "1"])

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            [_ async for _ in stub.Generate(_request("first", SHARED, 20), timeout=60)]
            [_ async for _ in stub.Generate(_request("again", SHARED, 20), timeout=60)]  # hits first's blocks
            [_ async for _ in stub.Generate(_request("forked", FORKED, 12, n=2), timeout=60)]
            call = stub.Generate(_request("aborted", [7, 8, 9] * 20, 5000), timeout=60)
            await call.read()
            assert (await stub.Abort(api_pb2.AbortRequest(request_id="aborted"), timeout=5)).found
            while await call.read() is not grpc.aio.EOF:
                pass

    asyncio.run(scenario())
    lines = _finished_lines(server, {"first", "again", "forked", "aborted"})
    assert set(lines) == {"first", "again", "forked", "aborted"}
    for request_id, line in lines.items():
        counts = {name: line[name] for name in BLOCK_FIELDS}
        assert all(isinstance(v, int) and v >= 0 for v in counts.values()), (request_id, counts)
        assert counts["blocks_allocated"] + counts["blocks_hit"] - counts["blocks_copied"] == counts["blocks_freed"], (
            request_id,
            counts,
        )
        assert counts["blocks_allocated"] >= 1 and counts["blocks_copied"] <= counts["blocks_hit"]
    assert lines["first"]["blocks_hit"] == 0 and lines["first"]["blocks_copied"] == 0
    assert lines["again"]["blocks_hit"] >= 1 and lines["again"]["cached_tokens"] > 0
    assert lines["again"]["blocks_allocated"] < lines["first"]["blocks_allocated"]
    assert lines["forked"]["n"] == 2 and lines["forked"]["blocks_copied"] >= 1
    assert lines["aborted"]["finish_reason"] == "abort" and lines["aborted"]["blocks_freed"] >= 1


def test_kv_reservation_flag_reaches_the_scheduler(serve_factory) -> None:
    """`--kv-reservation max-model-len` reserves a whole context per sequence: a pool smaller than one is refused."""
    server = serve_factory(
        ["--executor", "fake", "--num-blocks", "8", "--max-model-len", "1024", "--kv-reservation", "max-model-len"]
    )
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as info:
        list(api_pb2_grpc.KVServeStub(channel).Generate(_request("tiny", [1, 2, 3], 2), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "kv_reservation=max-model-len" in info.value.details()
