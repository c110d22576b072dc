"""Cancel, deadline and disconnect abort a request within one step, in every state.

A long "blocker" request keeps the engine stepping, so the step counter measures how
long the target lingers after the client let go: it must be gone within 2 steps (the
step in flight when the abort arrives, then the boundary where it is applied). Swapped
requests are covered with swap-preemption on a pool too small for the load.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.testing.server_launcher import ServeProcess
from kvserve.testing.stream_requests import greedy_request
from kvserve.testing.waiting import wait_until_async

pytestmark = pytest.mark.timeout(120)

STEP_MS = 40
MAX_STEPS_TO_ABORT = 2
BLOCKER_TOKENS = 3000
LONG_PROMPT = 2000
"""With --max-num-batched-tokens 64 its prefill spans ~32 steps (longer than the 0.5 s deadline)."""


SERVER_ARGS = [
    *("--num-blocks", "1024", "--step-latency-ms", str(STEP_MS)),
    *("--max-num-seqs", "2", "--max-num-batched-tokens", "64"),
]
"""The fake-executor server of the `server` fixture (tests/reliability/conftest.py)."""


async def _wait(server: ServeProcess, predicate, timeout_s: float = 20.0) -> api_pb2.ServerStatsResponse:
    """The first stats that satisfy `predicate` (polled often: the tests count steps between two stats)."""
    last: list[api_pb2.ServerStatsResponse] = []

    async def satisfied() -> api_pb2.ServerStatsResponse | None:
        stats = await asyncio.to_thread(server.stats)
        last[:] = [stats]
        return stats if predicate(stats) else None

    return await wait_until_async(
        satisfied, timeout_s, lambda: f"server stats to match; last stats {last}", interval_s=0.005
    )


@pytest.mark.parametrize("how", ["cancel", "deadline", "disconnect", "abort_rpc"])
@pytest.mark.parametrize("state", ["queued", "prefilling", "decoding"])
def test_abort_within_one_step(server: ServeProcess, state: str, how: str) -> None:
    async def scenario() -> int:
        control = server.aio_channel()
        target_channel = server.aio_channel()
        control_stub = api_pb2_grpc.KVServeStub(control)
        stub = api_pb2_grpc.KVServeStub(target_channel)
        blockers = [
            control_stub.Generate(greedy_request(9000 + i, BLOCKER_TOKENS), timeout=60)
            for i in range(2 if state == "queued" else 1)
        ]
        for blocker in blockers:
            await blocker.read()
        request_id = f"target-{state}-{how}"
        if state == "prefilling":
            request = greedy_request(1, 50, prompt_len=LONG_PROMPT, request_id=request_id)
        else:
            request = greedy_request(2, 2000, request_id=request_id)
        timeout = None
        if how == "deadline":
            timeout = 0.5
        call = stub.Generate(request, timeout=timeout)
        if state == "queued":
            await _wait(server, lambda s: s.requests_waiting == 1)
        elif state == "prefilling":
            running = await _wait(server, lambda s: s.requests_running == 2)
            await _wait(server, lambda s: s.steps >= running.steps + 2)
            assert not call.done()
        else:
            await call.read()  # a token arrived: it is decoding
        if how == "deadline":
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        steps_before = (await asyncio.to_thread(server.stats)).steps
        if how == "cancel":
            call.cancel()
        elif how == "disconnect":
            await target_channel.close(grace=None)
        elif how == "abort_rpc":
            assert (await control_stub.Abort(api_pb2.AbortRequest(request_id=request_id), timeout=5)).found
        gone = await _wait(server, lambda s: s.requests_waiting + s.requests_running == len(blockers))
        for blocker in blockers:
            blocker.cancel()
        await _wait(server, lambda s: s.requests_running == 0 and s.blocks_referenced == 0)
        await target_channel.close()
        await control.close()
        return gone.steps - steps_before

    steps_taken = asyncio.run(scenario())
    print(f"MEASURED abort {state}/{how}: gone after {steps_taken} steps")
    assert steps_taken <= MAX_STEPS_TO_ABORT


def test_abort_while_swapped_frees_cpu_and_device_blocks(serve) -> None:
    # 24 device blocks hold 384 tokens; eight 32-token prompts growing to 232 must preempt by swapping.
    server = serve(
        [
            "--executor",
            "fake",
            "--num-blocks",
            "24",
            "--step-latency-ms",
            "10",
            "--preemption-mode",
            "swap",
            "--num-cpu-blocks",
            "256",
        ]
    )

    async def scenario() -> api_pb2.ServerStatsResponse:
        async with server.aio_channel() as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            calls = [stub.Generate(greedy_request(i, 200, prompt_len=32), timeout=60) for i in range(8)]
            swapped = await _wait(server, lambda s: s.requests_swapped > 0)
            steps_before = swapped.steps
            for call in calls:
                call.cancel()
            gone = await _wait(server, lambda s: s.requests_swapped + s.requests_running + s.requests_waiting == 0)
            assert gone.steps - steps_before <= MAX_STEPS_TO_ABORT
            return await _wait(server, lambda s: s.blocks_referenced == 0)

    stats = asyncio.run(scenario())
    assert stats.blocks_free + stats.blocks_cached == stats.num_blocks
    assert stats.num_preemptions > 0
