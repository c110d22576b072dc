"""The asyncio client: `grpc.aio` calls wrapped in plain types and KVServeError.

Streams are explicit objects rather than async generators so that `cancel()`, leaving an
`async with` block, cancelling the consuming task, or dropping the stream each cancel the
RPC at once; the server then aborts the request and frees its KV blocks within a step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
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


def _current_task_cancelling() -> bool:
    """Whether the running task itself is being cancelled (Python 3.11+ can tell; assume so before)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return True if cancelling is None else bool(cancelling())


class AsyncChunkStream:
    """Async iterator of Chunks for one Generate call. Use `async with` or `cancel()` to stop early."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call
        self._cancelled = False

    def __aiter__(self) -> AsyncChunkStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._cancelled:
            raise StopAsyncIteration
        try:
            response = await self._call.read()
        except asyncio.CancelledError:
            if self._cancelled and not _current_task_cancelling():
                raise StopAsyncIteration from None  # our own cancel() interrupted a pending read
            self._call.cancel()  # the consuming task was cancelled: stop the RPC too
            raise
        except grpc.RpcError as error:
            if self._cancelled:
                raise StopAsyncIteration from None
            raise KVServeError.from_rpc_error(error) from None
        if response is grpc.aio.EOF:
            raise StopAsyncIteration
        return chunk_from_response(response)

    def cancel(self) -> bool:
        """Cancel the RPC; iteration then stops. Returns False if the call had already ended."""
        self._cancelled = True
        return self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncChunkStream:
        return self

    async def __aexit__(self, *_exc_info: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        call = getattr(self, "_call", None)
        if call is not None and not call.done():
            call.cancel()


class AsyncClient(Connection):
    """asyncio client for one kvserve server; see `Connection` for the meaning of each argument.
    Non-OK statuses raise KVServeError."""

    def _open(self, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
        if credentials is None:
            return grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(self.target, credentials, options=CHANNEL_OPTIONS)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        channel = self._forget_channel()
        if channel is not None:
            await channel.close()

    def stream(self, prompt: str | None = None, *, timeout_s: float | None = None, **request: Any) -> AsyncChunkStream:
        """Start a Generate call. `request`: `build_generate_request`'s keywords (one prompt form, request id,
        priority, cache salt, `structured`, `model`: a LoRA adapter's name) and api.proto SamplingParams field
        names."""
        message = build_generate_request(prompt, **request)
        call = self._stub.Generate(message, **self._call_options(timeout_s))
        return AsyncChunkStream(call)

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """Run a Generate call to the end and return the assembled Completion (all n choices)."""
        assembler = CompletionAssembler(requested_n(kwargs))
        async with self.stream(prompt, **kwargs) as chunks:
            async for chunk in chunks:
                assembler.add(chunk)
        return assembler.result()

    async def _unary(self, call: Call, *args: Any, timeout_s: float | None = None) -> Any:
        try:
            response = await getattr(self._stub_of(call), call.method)(
                call.build(*args), **self._call_options(timeout_s)
            )
        except grpc.RpcError as error:
            raise KVServeError.from_rpc_error(error) from None
        return call.read(response)

    async def abort(self, request_id: str) -> bool:
        """Abort a running request; True if the server knew it."""
        return await self._unary(calls.ABORT, request_id)

    async def tokenize(
        self, text: str | None = None, *, messages: Iterable[Mapping[str, str]] | None = None
    ) -> list[int]:
        """Token ids of `text`, or of `messages` rendered with the chat template."""
        return await self._unary(calls.TOKENIZE, text, messages)

    async def model_info(self) -> dict[str, Any]:
        return await self._unary(calls.MODEL_INFO)

    async def server_stats(self) -> dict[str, Any]:
        return await self._unary(calls.SERVER_STATS)

    async def load_lora_adapter(self, name: str, path: str) -> list[str]:
        """Load the adapter PEFT saved in `path` (absolute, on the server) as `name`; the adapters served then."""
        return await self._unary(calls.LOAD_LORA_ADAPTER, name, path)

    async def unload_lora_adapter(self, name: str) -> list[str]:
        """Unload the adapter `name` (refused while requests run under it); the adapters served then."""
        return await self._unary(calls.UNLOAD_LORA_ADAPTER, name)

    async def health(self, timeout_s: float | None = None) -> str:
        """The grpc.health.v1 status of the server: "SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN"."""
        return await self._unary(calls.HEALTH, timeout_s=timeout_s)

    async def wait_until_serving(self, timeout_s: float) -> None:
        """Poll health until SERVING; raise KVServeError(DEADLINE_EXCEEDED) after `timeout_s`."""
        wait = calls.ServingWait(self.target, timeout_s)
        while not wait.done:
            probe_timeout = wait.probe_timeout()
            try:
                wait.saw(await self.health(timeout_s=probe_timeout))
            except KVServeError as error:
                wait.failed(error)
            await asyncio.sleep(wait.pause())
