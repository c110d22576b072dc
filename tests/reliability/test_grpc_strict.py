"""Bodies that are not valid protobuf get INVALID_ARGUMENT, on every KVServe method (and health
and reflection), never UNKNOWN or INTERNAL, and the server logs no traceback for them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvserve.protos.grpc.reflection.v1 import reflection_pb2 as reflection_v1_pb2
from kvserve.protos.kvserve.v1 import api_pb2

pytestmark = pytest.mark.timeout(300)

KVSERVE = api_pb2.DESCRIPTOR.services_by_name["KVServe"]
OTHER_SERVICES = (
    health_pb2.DESCRIPTOR.services_by_name["Health"],
    reflection_v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
)
ALL_METHODS = [*KVSERVE.methods, *(m for s in OTHER_SERVICES for m in s.methods)]
FUZZ_EXAMPLES = 200
TOKEN = "strict-decoding-token-0000000001"


SERVER_ARGS = ["--num-blocks", "512", "--step-latency-ms", "2"]
"""The fake-executor server of the `server` fixture (tests/reliability/conftest.py)."""


@pytest.fixture(scope="module")
def channel(server) -> Iterator[grpc.Channel]:
    with server.channel() as channel:
        yield channel


def _path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def _call_raw(channel: grpc.Channel, method: MethodDescriptor, body: bytes, metadata=()) -> tuple[grpc.StatusCode, str]:
    """Send `body` as the request bytes, unserialized; read at most one response."""
    path, kwargs = _path(method), {"request_serializer": None, "response_deserializer": None}
    try:
        if method.client_streaming:
            call = channel.stream_stream(path, **kwargs)(iter([body]), timeout=10, metadata=metadata)
        elif method.server_streaming:
            call = channel.unary_stream(path, **kwargs)(body, timeout=10, metadata=metadata)
        else:
            channel.unary_unary(path, **kwargs)(body, timeout=10, metadata=metadata)
            return grpc.StatusCode.OK, ""
        next(call, None)
        call.cancel()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _request_type(method: MethodDescriptor):
    return message_factory.GetMessageClass(method.input_type)


def _decodes(method: MethodDescriptor, body: bytes) -> bool:
    try:
        _request_type(method).FromString(body)
    except DecodeError:
        return False
    return True


def _string_field_number(method: MethodDescriptor) -> int:
    """A string field of the request, or field 1 when it has none (then bad UTF-8 is unknown bytes)."""
    fields = [f for f in method.input_type.fields if f.type == FieldDescriptor.TYPE_STRING]
    return fields[0].number if fields else 1


def _bad_utf8(method: MethodDescriptor) -> bytes:
    tag = (_string_field_number(method) << 3) | 2
    return bytes([tag, 2, 0xC3, 0x28])  # 0xC3 opens a 2-byte sequence that 0x28 cannot continue


BAD_BODIES = {
    "random bytes": lambda m: b"\xff\xff\xff\xff",
    "bad UTF-8 in a string field": _bad_utf8,
    "truncated varint": lambda m: b"\x08\xff",
    "length past the end": lambda m: b"\x0a\x05ab",
}


# A request type without string fields takes "bad UTF-8" as an unknown field: valid, so left out.
BAD_CASES = [(m, case) for m in ALL_METHODS for case in sorted(BAD_BODIES) if not _decodes(m, BAD_BODIES[case](m))]


@pytest.mark.parametrize(("method", "case"), BAD_CASES, ids=[f"{_path(m)}-{case}" for m, case in BAD_CASES])
def test_undecodable_body_gets_invalid_argument(channel, method: MethodDescriptor, case: str) -> None:
    code, details = _call_raw(channel, method, BAD_BODIES[case](method))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith(f"request: not a valid {method.input_type.full_name} message: "), details


@st.composite
def _undecodable(draw) -> tuple[MethodDescriptor, bytes]:
    method = draw(st.sampled_from(list(KVSERVE.methods)))
    valid = _request_type(method)(**({"text": draw(st.text(max_size=8))} if method.name == "Tokenize" else {}))
    body = draw(
        st.one_of(
            st.binary(min_size=1, max_size=64),
            # a valid message, then a field cut short: varint, length-delimited, fixed64
            st.sampled_from([b"\x08\x80", b"\x12\x09abc", b"\x19\x01\x02"]).map(valid.SerializeToString().__add__),
            st.binary(max_size=16).map(lambda tail: _bad_utf8(method) + tail),
        )
    )
    assume(not _decodes(method, body))
    return method, body


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(case=_undecodable())
def test_fuzzed_undecodable_bodies_get_only_invalid_argument(channel, case) -> None:
    method, body = case
    code, details = _call_raw(channel, method, body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (_path(method), body, code, details)
    assert details.startswith("request: not a valid kvserve.v1."), details


def test_valid_raw_bodies_still_work(channel) -> None:
    code, _ = _call_raw(channel, KVSERVE.methods_by_name["ModelInfo"], b"")
    assert code == grpc.StatusCode.OK
    request = api_pb2.GenerateRequest(text="hi", sampling=api_pb2.SamplingParams(max_tokens=2, temperature=0))
    with_unknown_field = request.SerializeToString() + b"\xf8\x07\x01"  # field 127, varint: skipped
    code, details = _call_raw(channel, KVSERVE.methods_by_name["Generate"], with_unknown_field)
    assert code == grpc.StatusCode.OK, details


def test_server_stays_healthy_and_logs_no_traceback(server) -> None:
    # runs after the tests above in file order; also meaningful alone
    with server.channel() as channel:
        code, _ = _call_raw(channel, KVSERVE.methods_by_name["Generate"], b"\xff\xff\xff")
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    stats = server.wait_idle()
    assert stats.requests_running == 0 and stats.blocks_referenced == 0
    events = server.log_events("undecodable_request")
    assert events and events[-1]["method"] == "/kvserve.v1.KVServe/Generate", events[-1:]
    log = server.log_text()
    assert "Traceback" not in log and "DecodeError" not in log


def test_auth_still_comes_first() -> None:
    """With bearer auth on, an undecodable body without a token is UNAUTHENTICATED (the parser
    never sees it); with a valid token it is INVALID_ARGUMENT; reflection stays open."""
    from kvserve.scheduler.server.grpc_api.api_server import ApiServer, KVServeServicer
    from kvserve.scheduler.server.security.auth import BearerAuthInterceptor, TokenTable
    from kvserve.scheduler.server.server_config import ServerConfig

    table = TokenTable([(TOKEN, "alice")])
    bad = b"\xff\xff\xff"

    async def scenario() -> list[grpc.StatusCode]:
        api = ApiServer(
            ServerConfig(port=0), KVServeServicer(tokens=table), interceptors=[BearerAuthInterceptor(table)]
        )
        port = await api.start()
        try:
            return await asyncio.to_thread(_auth_codes, f"127.0.0.1:{port}")
        finally:
            await api.stop(0)

    def _auth_codes(address: str) -> list[grpc.StatusCode]:
        bearer = (("authorization", f"Bearer {TOKEN}"),)
        generate, abort = KVSERVE.methods_by_name["Generate"], KVSERVE.methods_by_name["Abort"]
        reflection = OTHER_SERVICES[1].methods_by_name["ServerReflectionInfo"]
        list_services = reflection_v1_pb2.ServerReflectionRequest(list_services="").SerializeToString()
        with grpc.insecure_channel(address) as channel:
            return [
                _call_raw(channel, generate, bad)[0],
                _call_raw(channel, abort, bad)[0],
                _call_raw(channel, generate, bad, metadata=bearer)[0],
                _call_raw(channel, abort, bad, metadata=bearer)[0],
                _call_raw(channel, abort, api_pb2.AbortRequest(request_id="x").SerializeToString(), bearer)[0],
                _call_raw(channel, reflection, list_services)[0],
                _call_raw(channel, reflection, bad)[0],
            ]

    assert asyncio.run(scenario()) == [
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OK,
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
    ]
