"""An executor that samples a token the structured-output grammar forbids: an internal error, not an outage.

The fake executor runs with `--fault-violate-token-masks` (fault injection: under a mask it draws a
token the mask forbids). The scheduler must fail such a request with an internal error (HTTP 500,
gRPC INTERNAL) whose message names the fault and the request id, log the fault with the request id,
end the request's other completions, and keep serving; it is never the 503 "executor change" error.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2

from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.testing.server_launcher import ServeProcess, serving
from kvserve.testing.waiting import wait_until
from tests.http.http_clients import FAKE_ARGS, sdk

pytestmark = pytest.mark.timeout(300)

FAULT = "the executor sampled a token the grammar forbids"
LOGGED = "executor sampled a token the grammar forbids"
"""The scheduler's log event for it."""
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}},
    "required": ["color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    args = [*FAKE_ARGS, "--fault-violate-token-masks"]
    with serving(args, tmp_path_factory.mktemp("grammar-violation"), http=True) as server:
        yield server


def _fault_logged(server: ServeProcess, client_request_id: str) -> dict:
    """The server's log line for the fault in this request (its request id is the scoped `tenant/id`)."""
    return wait_until(
        lambda: next(
            (
                e
                for e in server.log_events(LOGGED)
                if e.get("request_id", "").endswith("/" + client_request_id) and e.get("level") == "error"
            ),
            None,
        ),
        30,
        f"the fault's log line for {client_request_id}",
    )


def _finished_as(server: ServeProcess, client_request_id: str) -> str:
    event = wait_until(
        lambda: next(
            (
                e
                for e in server.log_events("request_finished")
                if e.get("request_id", "").endswith("/" + client_request_id)
            ),
            None,
        ),
        30,
        f"request_finished for {client_request_id}",
    )
    return event["finish_reason"]


def _assert_serving(server: ServeProcess) -> None:
    """Still healthy: SERVING, an unconstrained request completes, and nothing is left running or referenced."""
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    client = sdk(server)
    ok = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Hi"}], max_tokens=5
    )
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 5
    stats = server.wait_idle()
    assert (stats.requests_running, stats.requests_waiting, stats.blocks_referenced) == (0, 0, 0)
    assert stats.executor_restarts == 0  # the executor lives on: nothing was restarted or re-synced


def test_http_json_schema_gets_a_500_naming_the_fault_and_the_server_carries_on(faulty_server) -> None:
    client = sdk(faulty_server)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "Pick a color."}],
            response_format={"type": "json_schema", "json_schema": {"name": "color", "schema": SCHEMA}},
            max_tokens=50,
        )
    assert info.value.status_code == 500
    assert isinstance(info.value.body, dict), info.value
    message = info.value.body["message"]
    assert FAULT in message and "executor change" not in message
    found = re.search(r"internal error in request (chatcmpl-[0-9a-f]+):", message)
    assert found, message
    request_id = found.group(1)
    event = _fault_logged(faulty_server, request_id)
    assert event["request_id"] == f"anonymous/{request_id}"
    assert _finished_as(faulty_server, request_id) == "internal"
    _assert_serving(faulty_server)


def test_http_streaming_ends_with_an_internal_error_event(faulty_server) -> None:
    client = sdk(faulty_server)
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Pick a color, streamed."}],
        response_format={"type": "json_schema", "json_schema": {"name": "color", "schema": SCHEMA}},
        max_tokens=50,
        stream=True,
    )
    with pytest.raises(openai.APIError) as info:
        for _ in stream:
            pass
    assert FAULT in info.value.message
    _assert_serving(faulty_server)


def test_grpc_gets_internal_and_every_completion_of_the_request_ends(faulty_server) -> None:
    request_id = "grammar-fault-n2"
    request = api_pb2.GenerateRequest(
        request_id=request_id,
        text="Pick a color.",
        sampling=api_pb2.SamplingParams(max_tokens=50, n=2, seed=3, temperature=1.0),
        structured=api_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA)),
    )

    async def generate() -> None:
        async with faulty_server.aio_channel() as channel:
            async for _ in api_pb2_grpc.KVServeStub(channel).Generate(request, timeout=60):
                pass

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(generate())
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert re.fullmatch(rf"internal error in request {request_id}: {FAULT} \(token id \d+\)", info.value.details())
    _fault_logged(faulty_server, request_id)
    # Both completions violate; the request is logged once, as internal, and leaves nothing behind.
    assert set(_finished_as(faulty_server, request_id).split(",")) <= {"internal", "abort"}
    assert "internal" in _finished_as(faulty_server, request_id)
    _assert_serving(faulty_server)
