"""The blocking client: the same API as AsyncClient for scripts, notebooks and the CLI."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import grpc

from kvserve.clients import calls
from kvserve.clients.calls import Call
from kvserve.clients.channel import CHANNEL_OPTIONS
from kvserve.clients.connection import Connection
from kvserve.clients.errors import KVServeError
from kvserve.clients.request_builder import (
    CompletionAssembler,
    build_generate_request,
    chunk_from_response,
    requested_n,
)
from kvserve.clients.types import Chunk, Completion


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

    def __exit__(self, *_exc_info: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        call = getattr(self, "_call", None)
        if call is not None and call.is_active():
            call.cancel()


class Client(Connection):
    """Blocking client for one kvserve server; see `Connection` for the meaning of each argument.
    Non-OK statuses raise KVServeError."""

    def _open(self, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
        if credentials is None:
            return grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        return grpc.secure_channel(self.target, credentials, options=CHANNEL_OPTIONS)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        channel = self._forget_channel()
        if channel is not None:
            channel.close()

    def stream(self, prompt: str | None = None, *, timeout_s: float | None = None, **request: Any) -> ChunkStream:
        """Start a Generate call. `request`: `build_generate_request`'s keywords (one prompt form, request id,
        priority, cache salt, `structured`, `model`: a LoRA adapter's name) and api.proto SamplingParams field
        names."""
        message = build_generate_request(prompt, **request)
        return ChunkStream(self._stub.Generate(message, **self._call_options(timeout_s)))

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """Run a Generate call to the end and return the assembled Completion (all n choices)."""
        assembler = CompletionAssembler(requested_n(kwargs))
        with self.stream(prompt, **kwargs) as chunks:
            for chunk in chunks:
                assembler.add(chunk)
        return assembler.result()

    def _unary(self, call: Call, *args: Any, timeout_s: float | None = None) -> Any:
        try:
            response = getattr(self._stub_of(call), call.method)(call.build(*args), **self._call_options(timeout_s))
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

    def load_lora_adapter(self, name: str, path: str) -> list[str]:
        """Load the adapter PEFT saved in `path` (absolute, on the server) as `name`; the adapters served then."""
        return self._unary(calls.LOAD_LORA_ADAPTER, name, path)

    def unload_lora_adapter(self, name: str) -> list[str]:
        """Unload the adapter `name` (refused while requests run under it); the adapters served then."""
        return self._unary(calls.UNLOAD_LORA_ADAPTER, name)

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
