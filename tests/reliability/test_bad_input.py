"""Hostile input against a running server: every bad field gets INVALID_ARGUMENT naming it,
and hypothesis-generated requests get a valid stream or INVALID_ARGUMENT, never anything
else, while the server stays healthy and leaks nothing."""

from __future__ import annotations

import math

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import defaults
from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.testing.stream_requests import greedy_request

pytestmark = pytest.mark.timeout(300)

MAX_MODEL_LEN = 512
FUZZ_EXAMPLES = 150
CHUNKS_READ = 8
"""A valid fuzzed stream is read this far, checked, then cancelled (keeps the run short)."""


SERVER_ARGS = ["--num-blocks", "2048", "--step-latency-ms", "5", "--max-model-len", str(MAX_MODEL_LEN)]
"""The fake-executor server of the `server` fixture (tests/reliability/conftest.py)."""


@pytest.fixture(scope="module")
def stub(server):
    with server.channel() as channel:
        yield api_pb2_grpc.KVServeStub(channel)


@pytest.fixture(scope="module")
def vocab_size(stub) -> int:
    return stub.ModelInfo(api_pb2.ModelInfoRequest(), timeout=5).vocab_size


def _code_and_details(stub, request: api_pb2.GenerateRequest) -> tuple[grpc.StatusCode, str, list]:
    call = stub.Generate(request, timeout=30)
    chunks = []
    try:
        for chunk in call:
            chunks.append(chunk)
            if len(chunks) >= CHUNKS_READ:
                call.cancel()
                break
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", chunks
    return grpc.StatusCode.OK, "", chunks


def _text(text: str, **sampling) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(text=text, sampling=api_pb2.SamplingParams(**sampling))


def _ids(ids: list[int], **sampling) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=ids), sampling=api_pb2.SamplingParams(**sampling))


BAD_REQUESTS = {
    "empty text prompt": (_text(""), "text"),
    "no prompt at all": (api_pb2.GenerateRequest(), "prompt"),
    "empty token ids": (_ids([]), "token_ids"),
    "prompt over the context": (_ids([100] * MAX_MODEL_LEN), "token_ids"),
    "max_tokens zero": (_text("hi", max_tokens=0), "sampling.max_tokens"),
    "max_tokens negative": (_text("hi", max_tokens=-5), "sampling.max_tokens"),
    "max_tokens over the context": (_text("hi", max_tokens=MAX_MODEL_LEN), "sampling.max_tokens"),
    "temperature NaN": (_text("hi", temperature=math.nan), "sampling.temperature"),
    "temperature negative": (_text("hi", temperature=-0.5), "sampling.temperature"),
    "temperature infinite": (_text("hi", temperature=math.inf), "sampling.temperature"),
    "top_p zero": (_text("hi", top_p=0.0), "sampling.top_p"),
    "top_p above one": (_text("hi", top_p=1.5), "sampling.top_p"),
    "top_k below -1": (_text("hi", top_k=-2), "sampling.top_k"),
    "n over the limit": (_text("hi", n=defaults.MAX_N + 1), "sampling.n"),
    "too many stop strings": (_text("hi", stop=["x"] * (defaults.MAX_STOP_STRINGS + 1)), "sampling.stop"),
    "stop string too long": (_text("hi", stop=["x" * (defaults.MAX_STOP_STRING_CHARS + 1)]), "sampling.stop"),
    "logprobs too many": (_text("hi", logprobs=defaults.MAX_LOGPROBS + 1), "sampling.logprobs"),
    "seed negative": (_text("hi", seed=-1), "sampling.seed"),
    "unknown chat role": (
        api_pb2.GenerateRequest(chat=api_pb2.ChatPrompt(messages=[api_pb2.ChatMessage(role="wizard", content="hi")])),
        "chat.messages[0].role",
    ),
    "empty chat": (api_pb2.GenerateRequest(chat=api_pb2.ChatPrompt()), "chat.messages"),
    "token id negative": (_ids([1, -3, 2]), "token_ids"),
    "stop token id out of range": (_text("hi", stop_token_ids=[2**40]), "sampling.stop_token_ids"),
    "request_id too long": (api_pb2.GenerateRequest(text="hi", request_id="r" * 1000), "request_id"),
    "request_id not printable": (api_pb2.GenerateRequest(text="hi", request_id="a\nb"), "request_id"),
    "priority huge": (api_pb2.GenerateRequest(text="hi", priority=2**62), "priority"),
    "cache_salt too long": (api_pb2.GenerateRequest(text="hi", cache_salt="s" * 5000), "cache_salt"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_field_gets_invalid_argument_naming_it(stub, case: str) -> None:
    request, field = BAD_REQUESTS[case]
    code, details, _ = _code_and_details(stub, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith(field), details


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_zero_or_minus_one_is_off(stub, top_k: int) -> None:
    """0 used to be refused; now it means off, like -1 (and like Hugging Face and vLLM)."""
    code, details, chunks = _code_and_details(stub, _text("hi", top_k=top_k, max_tokens=2, temperature=0.5))
    assert code == grpc.StatusCode.OK, (code, details)
    assert chunks[-1].finish_reason == api_pb2.FINISH_REASON_LENGTH


def test_token_id_outside_the_vocabulary(stub, vocab_size: int) -> None:
    code, details, _ = _code_and_details(stub, _ids([1, vocab_size]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("token_ids"), details


def test_oversize_message_gets_invalid_argument_naming_the_prompt(server) -> None:
    options = [("grpc.max_send_message_length", 8 * defaults.MAX_REQUEST_BYTES)]
    with grpc.insecure_channel(server.address, options=options) as channel:
        stub = api_pb2_grpc.KVServeStub(channel)
        code, details, _ = _code_and_details(stub, _text("x" * (defaults.MAX_REQUEST_BYTES + 1)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("text:"), details
        # Two varint bytes per id: just over the limit.
        ids = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=[1000] * (defaults.MAX_REQUEST_BYTES // 2 + 16)))
        code, details, _ = _code_and_details(stub, ids)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("token_ids:"), details
        # Far past the limit the transport refuses it before buffering the whole message.
        code, _, _ = _code_and_details(stub, _text("x" * (5 * defaults.MAX_REQUEST_BYTES)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_duplicate_request_id_in_flight(server, stub) -> None:
    first = stub.Generate(greedy_request(1, 400, request_id="dup-id"), timeout=30)
    next(first)
    code, details, _ = _code_and_details(stub, greedy_request(2, 3, request_id="dup-id"))
    first.cancel()
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request_id"), details
    server.wait_idle()
    code, _, _ = _code_and_details(stub, greedy_request(2, 3, request_id="dup-id"))  # free again once it ended
    assert code == grpc.StatusCode.OK


# --- fuzzing ------------------------------------------------------------------------------

_INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-3, 3), st.sampled_from([0.0, 1.0]))
_SMALL_INTS = st.one_of(st.integers(-5, 40), _INT64)
_ROLES = st.one_of(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=12))


@st.composite
def _sampling(draw) -> api_pb2.SamplingParams:
    pb = api_pb2.SamplingParams()
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if draw(st.booleans()):
            setattr(pb, name, draw(_FLOATS))
    for name in ("top_k", "seed", "n", "max_tokens", "min_tokens", "logprobs"):
        if draw(st.booleans()):
            setattr(pb, name, draw(_SMALL_INTS))
    pb.stop_token_ids.extend(draw(st.lists(_SMALL_INTS, max_size=4)))
    pb.stop.extend(draw(st.lists(st.text(max_size=8), max_size=4)))
    pb.ignore_eos = draw(st.booleans())
    return pb


@st.composite
def _requests(draw) -> api_pb2.GenerateRequest:
    request = api_pb2.GenerateRequest()
    kind = draw(st.sampled_from(["text", "token_ids", "chat", "none"]))
    if kind == "text":
        request.text = draw(st.text(max_size=64))
    elif kind == "token_ids":
        ids = st.one_of(st.integers(0, 49151), _INT64)
        request.token_ids.ids.extend(draw(st.lists(ids, max_size=32)))
    elif kind == "chat":
        for role, content in draw(st.lists(st.tuples(_ROLES, st.text(max_size=24)), max_size=4)):
            request.chat.messages.append(api_pb2.ChatMessage(role=role, content=content))
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(_sampling()))
    if draw(st.booleans()):
        request.request_id = draw(st.text(max_size=20))
    request.priority = draw(_SMALL_INTS)
    request.cache_salt = draw(st.text(max_size=16))
    return request


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=_requests())
def test_fuzzed_requests_get_a_valid_stream_or_invalid_argument(
    stub, vocab_size: int, request: api_pb2.GenerateRequest
) -> None:
    code, details, chunks = _code_and_details(stub, request)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert ":" in details and details.split(":", 1)[0], details  # "field: message"
        return
    assert code == grpc.StatusCode.OK, (code, details)
    assert chunks, "a stream that ended without a chunk"
    n = request.sampling.n if request.sampling.HasField("n") else 1
    for chunk in chunks:
        assert 0 <= chunk.index < n
        assert all(0 <= t < vocab_size for t in chunk.token_ids)
        if chunk.finish_reason:
            assert chunk.usage.prompt_tokens > 0


def test_server_is_healthy_and_clean_after_the_fuzzing(server) -> None:
    # runs after the fuzz test in file order; also meaningful alone
    assert server.process.poll() is None
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    stats = server.wait_idle()
    assert stats.blocks_referenced == 0 and stats.requests_running == 0
    assert "Traceback" not in server.log_text()
