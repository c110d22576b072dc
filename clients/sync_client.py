"""The blocking client: the same API as AsyncClient for scripts, notebooks and the CLI."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvserve.clients import calls
from kvserve.clients.calls import Call
from kvserve.clients.channel import CHANNEL_OPTIONS, DEFAULT_TARGET, bearer_metadata
from kvserve.clients.errors import KVServeError
from kvserve.clients.request_builder import (
    CompletionAssembler,
    build_generate_request,
    chunk_from_response,
    requested_n,
)
from kvserve.clients.types import Chunk, Completion
from kvserve.protos.kvserve.v1 import api_pb2_grpc


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

    def stream(self, prompt: str | None = None, *, timeout_s: float | None = None, **request: Any) -> ChunkStream:
        """Start a Generate call. `request`: `build_generate_request`'s keywords (one prompt form, request id,
        priority, cache salt, `structured`) and api.proto SamplingParams field names."""
        message = build_generate_request(prompt, **request)
        return ChunkStream(self._stub.Generate(message, timeout=self._timeout(timeout_s), metadata=self._metadata))

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """Run a Generate call to the end and return the assembled Completion (all n choices)."""
        assembler = CompletionAssembler(requested_n(kwargs))
        with self.stream(prompt, **kwargs) as chunks:
            for chunk in chunks:
                assembler.add(chunk)
        return assembler.result()

    def _unary(self, call: Call, *args: Any, timeout_s: float | None = None) -> Any:
        stub = self._health if call.health else self._stub
        try:
            response = getattr(stub, call.method)(
                call.build(*args), timeout=self._timeout(timeout_s), metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise KVServeError.from_rpc_error(error) from None
        return call.read(response)

    def abort(self, request_id: str) -> bool:
        return self._unary(calls.ABORT, request_id)

    def tokenize(self, text: str | None = None, *, messages: Iterable[Mapping[str, str]] | None = None) -> list[int]:
        return self._unary(calls.TOKENIZE, text, messages)

    def model_info(self) -> dict[str, Any]:
        return self._unary(calls.MODEL_INFO)

    def server_stats(self) -> dict[str, Any]:
        return self._unary(calls.SERVER_STATS)

    def health(self, timeout_s: float | None = None) -> str:
        return self._unary(calls.HEALTH, timeout_s=timeout_s)

    def wait_until_serving(self, timeout_s: float) -> None:
        """Poll health until SERVING; raise KVServeError(DEADLINE_EXCEEDED) after `timeout_s`."""
        wait = calls.ServingWait(self.target, timeout_s)
        while not wait.done:
            probe_timeout = wait.probe_timeout()
            try:
                wait.saw(self.health(timeout_s=probe_timeout))
            except KVServeError as error:
                wait.failed(error)
            time.sleep(wait.pause())
