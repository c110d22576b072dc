"""The blocking client against the scripted in-process gRPC server."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvserve.clients import Client, KVServeError


def test_stream_yields_chunks_in_order(scripted_server) -> None:
    with Client(scripted_server.target) as client:
        chunks = list(client.stream("a b c", max_tokens=3, temperature=0))
    assert [c.token_ids for c in chunks] == [[1000], [1001], [1002]]
    assert "".join(c.text for c in chunks) == " w0 w1 w2"
    assert [c.finish_reason for c in chunks] == [None, None, "length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])
    sent = scripted_server.servicer.recorded.requests[0]
    assert sent.text == "a b c" and sent.sampling.max_tokens == 3 and sent.sampling.HasField("temperature")


def test_generate_assembles_n_choices_with_logprobs(scripted_server) -> None:
    with Client(scripted_server.target) as client:
        completion = client.generate("x y", n=3, max_tokens=2, logprobs=2)
    assert len(completion.choices) == 3
    assert [c.token_ids for c in completion.choices] == [[1000, 1001], [1100, 1101], [1200, 1201]]
    assert completion.text == " w0 w1" and completion.token_ids == [1000, 1001]
    assert completion.usage.completion_tokens == 2 and completion.choices[2].usage.e2e_s == pytest.approx(2.02)
    assert next(lp.top for lp in completion.choices[1].logprobs) == [(1100, -1.0), (1101, -2.0)]
    assert completion.request_id.startswith("req-")  # assigned by the server
    assert {c.request_id for c in completion.choices} == {completion.request_id}


def test_bearer_token_sent_as_metadata(scripted_server) -> None:
    with Client(scripted_server.target, token="s3cret") as client:
        client.generate("x", max_tokens=1)
    assert scripted_server.servicer.recorded.metadata[0]["authorization"] == "Bearer s3cret"


def test_no_token_sends_no_authorization(scripted_server) -> None:
    with Client(scripted_server.target) as client:
        client.generate("x", max_tokens=1)
    assert "authorization" not in scripted_server.servicer.recorded.metadata[0]


def test_cancel_cancels_server_stream(scripted_server) -> None:
    recorded = scripted_server.servicer.recorded
    with Client(scripted_server.target) as client:
        stream = client.stream("slow: go", max_tokens=10_000)
        first = [next(stream), next(stream)]
        assert stream.cancel() is True
        assert list(stream) == []  # iteration stops quietly after our own cancel
        assert recorded.cancelled.wait(5), "server never saw the cancellation"
    assert [c.token_ids for c in first] == [[1000], [1001]]
    assert recorded.chunks_sent < 100


def test_leaving_with_block_cancels(scripted_server) -> None:
    with Client(scripted_server.target) as client:
        with client.stream("slow: go", max_tokens=10_000) as stream:
            next(stream)
        assert scripted_server.servicer.recorded.cancelled.wait(5)


def test_deadline_maps_to_deadline_exceeded(scripted_server) -> None:
    with Client(scripted_server.target, timeout_s=0.3) as client:
        started = time.monotonic()
        with pytest.raises(KVServeError) as info:
            client.generate("stall: zzz")
    assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5


def test_per_call_timeout_overrides_default(scripted_server) -> None:
    with Client(scripted_server.target, timeout_s=60) as client, pytest.raises(KVServeError) as info:
        list(client.stream("stall: zzz", timeout_s=0.2))
    assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED"])
def test_status_maps_to_kvserve_error(scripted_server, code: str) -> None:
    with Client(scripted_server.target) as client, pytest.raises(KVServeError) as info:
        client.generate(f"error:{code}:sampling.top_p: must be in (0, 1]")
    assert info.value.code is grpc.StatusCode[code]
    assert info.value.details == "sampling.top_p: must be in (0, 1]"


def test_unreachable_server_is_unavailable() -> None:
    with Client("127.0.0.1:1", timeout_s=2) as client, pytest.raises(KVServeError) as info:
        client.model_info()
    assert info.value.code is grpc.StatusCode.UNAVAILABLE


def test_unary_calls(scripted_server) -> None:
    with Client(scripted_server.target) as client:
        assert client.abort("req-9") is True
        assert client.abort("other") is False
        assert client.tokenize("ab cde") == [2, 3]
        assert client.tokenize(messages=[{"role": "user", "content": "four"}]) == [4]
        info = client.model_info()
        stats = client.server_stats()
    assert scripted_server.servicer.recorded.aborted == ["req-9", "other"]
    assert info["model_id"] == "scripted-model" and info["eos_token_ids"] == [2]
    assert stats["blocks_free"] == 60 and stats["executor_state"] == "READY"


def test_health_and_wait_until_serving(scripted_server) -> None:
    with Client(scripted_server.target) as client:
        assert client.health() == "SERVING"
        scripted_server.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        assert client.health() == "NOT_SERVING"
        with pytest.raises(KVServeError) as info:
            client.wait_until_serving(timeout_s=0.3)
        assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and "NOT_SERVING" in info.value.details
        scripted_server.loop.call_later(
            0.3,
            lambda: scripted_server.loop.create_task(
                scripted_server.health.set("", health_pb2.HealthCheckResponse.SERVING)
            ),
        )
        client.wait_until_serving(timeout_s=5)
        assert client.health() == "SERVING"
