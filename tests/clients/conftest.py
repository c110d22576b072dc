"""A scripted in-process kvserve gRPC server for the client and CLI tests.

It runs a real `grpc.aio` server on a free loopback port, in its own thread and event
loop, so the sync client, the asyncio client and CLI subprocesses all talk to it over the
network exactly as they would to `kvserve serve`. Its answers are derived from the
request (no model): completion `i` of a request yields tokens `1000 + 100*i + k` with text
" w{k}" (k = 0 .. max_tokens-1). Prompts with a prefix change behaviour:

- `error:CODE:message` aborts the call with that status code and message;
- `slow:` streams one token every 50 ms until max_tokens (default: effectively forever);
- `stall:` sends nothing and sleeps (for deadlines).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc

STALL_S = 30.0
SLOW_STEP_S = 0.05


@dataclass(slots=True)
class Recorded:
    """What the scripted server saw during one test, for assertions.

    `reset` gives each test a fresh one, and a call keeps the record of the test that made it: a
    stream cancelled late, after its test ended, is written to that test's record and can never
    satisfy the next test's `cancelled.wait()`.
    """

    requests: list[api_pb2.GenerateRequest] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cancelled_ids: list[str] = field(default_factory=list)
    """The request ids (given, or `req-N`) of the streams that saw their cancellation, in order."""
    chunks_sent: int = 0


def scripted_chunks(request: api_pb2.GenerateRequest, request_id: str) -> list[api_pb2.GenerateResponse]:
    """The full response of a normal request, one token per chunk, n completions interleaved."""
    sampling = request.sampling
    n = sampling.n if sampling.HasField("n") else 1
    max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 4
    prompt_tokens = (
        len(request.text.split())
        if request.WhichOneof("prompt") == "text"
        else len(request.token_ids.ids)
        if request.WhichOneof("prompt") == "token_ids"
        else 7 * len(request.chat.messages)
    )
    chunks = []
    for k in range(max_tokens):
        for index in range(n):
            token = 1000 + 100 * index + k
            chunk = api_pb2.GenerateResponse(request_id=request_id, index=index, token_ids=[token], text=f" w{k}")
            if sampling.HasField("logprobs"):
                chunk.logprobs.add(
                    token_id=token,
                    logprob=-0.5 * (k + 1),
                    top=[api_pb2.Logprob(token_id=token + j, logprob=-1.0 * (j + 1)) for j in range(sampling.logprobs)],
                )
            if k == max_tokens - 1:
                chunk.finish_reason = api_pb2.FINISH_REASON_LENGTH
                chunk.usage.CopyFrom(
                    api_pb2.Usage(
                        prompt_tokens=prompt_tokens,
                        completion_tokens=max_tokens,
                        cached_tokens=prompt_tokens // 2,
                        queue_time_s=0.001,
                        ttft_s=0.01,
                        e2e_s=0.02 + index,
                    )
                )
            chunks.append(chunk)
    return chunks


class ScriptedServicer(api_pb2_grpc.KVServeServicer):
    def __init__(self) -> None:
        self.recorded = Recorded()
        self.stats = api_pb2.ServerStatsResponse(
            num_blocks=64,
            blocks_free=60,
            blocks_cached=3,
            blocks_referenced=1,
            kv_usage=1 / 64,
            requests_running=1,
            prefix_queried_tokens=100,
            prefix_hit_tokens=40,
            executor_state=api_pb2.EXECUTOR_STATE_READY,
            steps=12,
        )
        self._counter = 0

    async def Generate(
        self, request: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        recorded = self.recorded  # this test's record, even if the call outlives the test
        recorded.requests.append(request)
        recorded.metadata.append(dict(context.invocation_metadata()))
        self._counter += 1
        request_id = request.request_id or f"req-{self._counter}"
        text = request.text
        try:
            if text.startswith("error:"):
                _, code, message = text.split(":", 2)
                await context.abort(grpc.StatusCode[code], message)
            if text.startswith("stall:"):
                await asyncio.sleep(STALL_S)
            for chunk in scripted_chunks(request, request_id):
                if text.startswith("slow:"):
                    await asyncio.sleep(SLOW_STEP_S)
                recorded.chunks_sent += 1
                yield chunk
        except asyncio.CancelledError:
            recorded.cancelled_ids.append(request_id)
            recorded.cancelled.set()
            raise

    async def Abort(self, request: api_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> api_pb2.AbortResponse:
        self.recorded.aborted.append(request.request_id)
        return api_pb2.AbortResponse(found=request.request_id.startswith("req-"))

    async def Tokenize(
        self, request: api_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.TokenizeResponse:
        if request.WhichOneof("input") == "text":
            words = request.text.split()
        else:
            words = [m.content for m in request.chat.messages]
        return api_pb2.TokenizeResponse(token_ids=[len(w) for w in words], tokens=words)

    async def ModelInfo(
        self, request: api_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.ModelInfoResponse:
        return api_pb2.ModelInfoResponse(
            model_id="scripted-model",
            vocab_size=49152,
            max_model_len=2048,
            block_size=16,
            num_blocks=64,
            eos_token_ids=[2],
            executor_kind="fake",
            device="cpu",
            dtype="float32",
            attention_backend="none",
            has_chat_template=True,
        )

    async def ServerStats(
        self, request: api_pb2.ServerStatsRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.ServerStatsResponse:
        return self.stats


class ScriptedServer:
    """The server thread; `target` is its host:port, `servicer.recorded` what it saw."""

    def __init__(self) -> None:
        self.servicer = ScriptedServicer()
        self.health = health.aio.HealthServicer()
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scripted-grpc", daemon=True)
        self._server: grpc.aio.Server | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("scripted server did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self._started.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        self._server = grpc.aio.server()
        api_pb2_grpc.add_KVServeServicer_to_server(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    def set_health(self, status: int) -> None:
        asyncio.run_coroutine_threadsafe(self.health.set("", status), self.loop).result(5)

    def reset(self) -> None:
        self.servicer.recorded = Recorded()
        self.set_health(health_pb2.HealthCheckResponse.SERVING)

    def stop(self) -> None:
        assert self._server is not None
        asyncio.run_coroutine_threadsafe(self._server.stop(None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="session")
def _scripted_server_session() -> Iterator[ScriptedServer]:
    server = ScriptedServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def scripted_server(_scripted_server_session: ScriptedServer) -> ScriptedServer:
    """The shared scripted server with its recordings cleared and health SERVING."""
    _scripted_server_session.reset()
    return _scripted_server_session


@pytest.fixture
def scratch(tmp_path: Path, default_model_dir: Path) -> Path:
    """Stands in for a compose file's model-cache volume: the default model already converted (a symlink)."""
    cache = tmp_path / "model-cache" / "models"
    cache.mkdir(parents=True)
    (cache / default_model_dir.name).symlink_to(default_model_dir, target_is_directory=True)
    return tmp_path
