"""The blocking client: the same API as AsyncClient for scripts, notebooks and the CLI."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.clients.channel import CHANNEL_OPTIONS, DEFAULT_TARGET, HEALTH_SERVICE, bearer_metadata
from kvserve.clients.errors import KVServeError
from kvserve.clients.request_builder import (
    CompletionAssembler,
    build_generate_request,
    chat_prompt,
    chunk_from_response,
    message_to_dict,
    requested_n,
)
from kvserve.clients.types import Chunk, Completion
from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc

_WAIT_POLL_S = 0.1


class ChunkStream:
    """Iterator of Chunks for one Generate call. `cancel()` (or leaving a `with` block) stops the RPC."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._cancelled = False

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        if self._cancelled:
            raise StopIteration
        try:
            response = next(self._call)
        except grpc.RpcError as error:
            if self._cancelled:
                raise StopIteration from None
            raise KVServeError.from_rpc_error(error) from None
        return chunk_from_response(response)

    def cancel(self) -> bool:
        """Cancel the RPC (the server aborts the request). Returns False if the call had already ended."""
        self._cancelled = True
        return self._call.cancel()

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        call = getattr(self, "_call", None)
        if call is not None and call.is_active():
            call.cancel()


class Client:
    """Blocking client for one kvserve server; see AsyncClient for the meaning of each argument."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._metadata = bearer_metadata(token)
        if root_certificates is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self._channel = grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = api_pb2_grpc.KVServeStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _timeout(self, timeout_s: float | None) -> float | None:
        return self.timeout_s if timeout_s is None else timeout_s

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def stream(
        self,
        prompt: str | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        messages: Iterable[Mapping[str, str]] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str = "",
        structured: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
        **sampling: Any,
    ) -> ChunkStream:
        """Start a Generate call; sampling keywords are api.proto SamplingParams field names.

        `structured` constrains the output, e.g. `{"json_schema": schema}` or `{"choice": ["yes", "no"]}`."""
        request = build_generate_request(
            prompt,
            token_ids=token_ids,
            messages=messages,
            request_id=request_id,
            priority=priority,
            cache_salt=cache_salt,
            structured=structured,
            **sampling,
        )
        return ChunkStream(self._stub.Generate(request, timeout=self._timeout(timeout_s), metadata=self._metadata))

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """Run a Generate call to the end and return the assembled Completion (all n choices)."""
        assembler = CompletionAssembler(requested_n(kwargs))
        with self.stream(prompt, **kwargs) as chunks:
            for chunk in chunks:
                assembler.add(chunk)
        return assembler.result()

    def _unary(self, method: Any, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return method(request, timeout=self._timeout(timeout_s), metadata=self._metadata)
        except grpc.RpcError as error:
            raise KVServeError.from_rpc_error(error) from None

    def abort(self, request_id: str) -> bool:
        return self._unary(self._stub.Abort, api_pb2.AbortRequest(request_id=request_id)).found

    def tokenize(self, text: str | None = None, *, messages: Iterable[Mapping[str, str]] | None = None) -> list[int]:
        if (text is None) == (messages is None):
            raise ValueError("give exactly one of text or messages")
        request = (
            api_pb2.TokenizeRequest(text=text)
            if text is not None
            else api_pb2.TokenizeRequest(chat=chat_prompt(messages or ()))
        )
        return list(self._unary(self._stub.Tokenize, request).token_ids)

    def model_info(self) -> dict[str, Any]:
        return message_to_dict(self._unary(self._stub.ModelInfo, api_pb2.ModelInfoRequest()))

    def server_stats(self) -> dict[str, Any]:
        return message_to_dict(self._unary(self._stub.ServerStats, api_pb2.ServerStatsRequest()))

    def health(self, timeout_s: float | None = None) -> str:
        response = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=HEALTH_SERVICE), timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_until_serving(self, timeout_s: float) -> None:
        """Poll health until SERVING; raise KVServeError(DEADLINE_EXCEEDED) after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise KVServeError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.target} not SERVING after {timeout_s:g}s (last: {last})"
                )
            try:
                last = self.health(timeout_s=max(min(remaining, 1.0), 0.01))
                if last == "SERVING":
                    return
            except KVServeError as error:
                if error.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                last = error.code.name
            time.sleep(min(_WAIT_POLL_S, max(deadline - time.monotonic(), 0)))
