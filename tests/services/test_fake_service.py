"""`kvserve serve --executor fake` end to end over gRPC: concurrency, cancel, validation, prefix cache."""

from __future__ import annotations

import asyncio
import random
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvserve.config import defaults
from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.testing.waiting import wait_until

pytestmark = pytest.mark.timeout(300)


def _generate_request(ids: list[int], max_tokens: int, **kwargs) -> api_pb2.GenerateRequest:
    sampling = api_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=ids), sampling=sampling, **kwargs)


async def _collect(stub: api_pb2_grpc.KVServeStub, request: api_pb2.GenerateRequest) -> list[api_pb2.GenerateResponse]:
    return [chunk async for chunk in stub.Generate(request, timeout=120)]


def _wait_until_idle(server, timeout_s: float = 20.0) -> api_pb2.ServerStatsResponse:
    """The first stats with nothing running, waiting or referenced."""

    def idle() -> api_pb2.ServerStatsResponse | None:
        stats = server.stats()
        return stats if not (stats.requests_running or stats.requests_waiting or stats.blocks_referenced) else None

    return wait_until(idle, timeout_s, "the server to be idle", interval_s=0.1)


def test_health_reflection_and_model_info(fake_server) -> None:
    assert fake_server.health() == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(fake_server.address) as channel:
        service = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="kvserve.v1.KVServe"), timeout=5
        )
        assert service.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(
            reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        )
        names = {s.name for s in replies[0].list_services_response.service}
        assert {"kvserve.v1.KVServe", "grpc.health.v1.Health"} <= names
        info = api_pb2_grpc.KVServeStub(channel).ModelInfo(api_pb2.ModelInfoRequest(), timeout=5)
        assert info.executor_kind == "fake" and info.block_size == defaults.BLOCK_SIZE and info.vocab_size > 0


def test_200_concurrent_streams_complete(fake_server) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randrange(5, 60))] for _ in range(200)]

    async def scenario() -> list[list[api_pb2.GenerateResponse]]:
        async with grpc.aio.insecure_channel(fake_server.address) as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            return await asyncio.gather(*(_collect(stub, _generate_request(p, 12)) for p in prompts))

    results = asyncio.run(scenario())
    for prompt, chunks in zip(prompts, results):
        tokens = [t for c in chunks for t in c.token_ids]
        assert len(tokens) == 12
        last = chunks[-1]
        assert last.finish_reason == api_pb2.FINISH_REASON_LENGTH
        assert last.usage.prompt_tokens == len(prompt) and last.usage.completion_tokens == 12
        assert all(c.finish_reason == api_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    assert _wait_until_idle(fake_server).blocks_referenced == 0


def test_cancelling_half_mid_stream_frees_every_block(fake_server) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 20000) for _ in range(40)] for _ in range(200)]

    async def one(stub, index: int, prompt: list[int]) -> tuple[str, int]:
        call = stub.Generate(_generate_request(prompt, 300 if index % 2 else 20), timeout=120)
        tokens = 0
        async for chunk in call:
            tokens += len(chunk.token_ids)
            if index % 2 and tokens >= 3:
                call.cancel()
                return "cancelled", tokens
        return "done", tokens

    async def scenario():
        async with grpc.aio.insecure_channel(fake_server.address) as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            return await asyncio.gather(*(one(stub, i, p) for i, p in enumerate(prompts)))

    outcomes = asyncio.run(scenario())
    assert [o for o, _ in outcomes] == ["done", "cancelled"] * 100
    assert all(tokens == 20 for o, tokens in outcomes if o == "done")
    stats = _wait_until_idle(fake_server)
    assert stats.blocks_referenced == 0
    assert stats.requests_running == 0 and stats.requests_waiting == 0
    assert stats.blocks_free + stats.blocks_cached == stats.num_blocks


INVALID = [
    (api_pb2.GenerateRequest(text=""), "text"),
    (api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=[10**9])), "token_ids"),
    (
        api_pb2.GenerateRequest(text="hi", sampling=api_pb2.SamplingParams(temperature=float("nan"))),
        "sampling.temperature",
    ),
    (api_pb2.GenerateRequest(text="hi", sampling=api_pb2.SamplingParams(top_p=1.5)), "sampling.top_p"),
    (api_pb2.GenerateRequest(text="hi", sampling=api_pb2.SamplingParams(top_k=-7)), "sampling.top_k"),
    (api_pb2.GenerateRequest(text="hi", sampling=api_pb2.SamplingParams(max_tokens=0)), "sampling.max_tokens"),
    (api_pb2.GenerateRequest(text="hi", sampling=api_pb2.SamplingParams(max_tokens=10**9)), "sampling.max_tokens"),
    (api_pb2.GenerateRequest(text="hi", sampling=api_pb2.SamplingParams(n=1000)), "sampling.n"),
    (
        api_pb2.GenerateRequest(chat=api_pb2.ChatPrompt(messages=[api_pb2.ChatMessage(role="wizard", content="x")])),
        "chat.messages[0].role",
    ),
]


@pytest.mark.parametrize(("request_pb", "field"), INVALID, ids=[f for _, f in INVALID])
def test_invalid_fields_get_invalid_argument_naming_the_field(fake_server, request_pb, field) -> None:
    with grpc.insecure_channel(fake_server.address) as channel, pytest.raises(grpc.RpcError) as info:
        list(api_pb2_grpc.KVServeStub(channel).Generate(request_pb, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}: ")
    assert fake_server.health() == health_pb2.HealthCheckResponse.SERVING


def test_duplicate_request_id_in_flight_is_refused(fake_server) -> None:
    async def scenario() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(fake_server.address) as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            first = stub.Generate(_generate_request([5, 6, 7], 500, request_id="dup-1"), timeout=60)
            await first.read()  # the first request is in flight
            second = stub.Generate(_generate_request([5, 6, 7], 5, request_id="dup-1"), timeout=60)
            try:
                async for _ in second:
                    pass
                code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                assert exc.details().startswith("request_id: ")
            first.cancel()
            return code

    assert asyncio.run(scenario()) == grpc.StatusCode.INVALID_ARGUMENT


def test_abort_rpc_ends_the_stream_with_abort(fake_server) -> None:
    async def scenario() -> tuple[bool, int]:
        async with grpc.aio.insecure_channel(fake_server.address) as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            call = stub.Generate(_generate_request([9, 8, 7], 1000, request_id="to-abort"), timeout=60)
            await call.read()
            found = (await stub.Abort(api_pb2.AbortRequest(request_id="to-abort"), timeout=5)).found
            last = None
            while (chunk := await call.read()) is not grpc.aio.EOF:
                last = chunk
            missing = (await stub.Abort(api_pb2.AbortRequest(request_id="to-abort"), timeout=5)).found
            assert not missing
            return found, last.finish_reason

    found, reason = asyncio.run(scenario())
    assert found and reason == api_pb2.FINISH_REASON_ABORT


def test_repeated_prompt_hits_the_prefix_cache_only_within_its_salt(fake_server) -> None:
    prompt = [random.Random(2).randrange(100, 20000) for _ in range(100)]
    with grpc.insecure_channel(fake_server.address) as channel:
        stub = api_pb2_grpc.KVServeStub(channel)

        def usage(salt: str) -> api_pb2.Usage:
            return list(stub.Generate(_generate_request(prompt, 4, cache_salt=salt), timeout=30))[-1].usage

        salt = uuid.uuid4().hex  # fresh salts: the shared server may have seen this prompt before
        first = usage(f"alpha-{salt}")
        again = usage(f"alpha-{salt}")
        other = usage(f"beta-{salt}")
    assert first.cached_tokens == 0
    assert again.cached_tokens >= len(prompt) - defaults.BLOCK_SIZE
    assert other.cached_tokens == 0


def test_tokenize_text_and_chat(fake_server) -> None:
    with grpc.insecure_channel(fake_server.address) as channel:
        stub = api_pb2_grpc.KVServeStub(channel)
        text = stub.Tokenize(api_pb2.TokenizeRequest(text="Hello world"), timeout=5)
        assert len(text.token_ids) == len(text.tokens) >= 2
        chat = stub.Tokenize(
            api_pb2.TokenizeRequest(
                chat=api_pb2.ChatPrompt(messages=[api_pb2.ChatMessage(role="user", content="Hello world")])
            ),
            timeout=5,
        )
        assert len(chat.token_ids) > len(text.token_ids)


def test_a_request_larger_than_the_kv_pool_is_invalid_argument(serve_factory) -> None:
    server = serve_factory(["--executor", "fake", "--num-blocks", "8"])  # 128 token slots
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as info:
        list(api_pb2_grpc.KVServeStub(channel).Generate(_generate_request(list(range(100, 150)), 200), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("sampling.max_tokens: ")


def test_logprobs_are_parallel_to_token_ids(fake_server) -> None:
    request = _generate_request([11, 12, 13, 14], 6)
    request.sampling.logprobs = 2
    with grpc.insecure_channel(fake_server.address) as channel:
        chunks = list(api_pb2_grpc.KVServeStub(channel).Generate(request, timeout=30))
    for chunk in chunks:
        assert [lp.token_id for lp in chunk.logprobs] == list(chunk.token_ids)
        assert all(len(lp.top) == 2 and lp.logprob <= 0.0 for lp in chunk.logprobs)
    assert sum(len(c.logprobs) for c in chunks) == 6


def test_a_long_text_prompt_is_tokenized_and_served(fake_server) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 600  # > 20k chars: tokenized off the event loop
    request = api_pb2.GenerateRequest(text=text, sampling=api_pb2.SamplingParams(max_tokens=3, ignore_eos=True))
    with grpc.insecure_channel(fake_server.address) as channel:
        chunks = list(api_pb2_grpc.KVServeStub(channel).Generate(request, timeout=60))
    assert chunks[-1].usage.prompt_tokens > 5000 and chunks[-1].usage.completion_tokens == 3
