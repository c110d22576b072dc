"""Register a gRPC service whose handlers decode their own requests, strictly.

The generated `add_*Servicer_to_server` functions hand grpc the message's `FromString` as
the request deserializer. A body that is not valid protobuf (random bytes, bad UTF-8 in a
string field, a truncated varint) then raises inside grpc's C core: the caller gets
UNKNOWN and the log a traceback. `add_strict_service` registers the same methods, built
from the service's descriptor, with no deserializer (grpc passes the raw bytes) and a thin
wrapper that parses them: an undecodable body ends the call with INVALID_ARGUMENT
"request: not a valid <type> message: <why>" and one `undecodable_request` warning line.

The servicer methods are unchanged and are called exactly as before, so interceptors
(auth) see the same handler shapes; a refused call never reaches the parser.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import grpc
import structlog
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message

log = structlog.get_logger(__name__)

_PROTOBUF_PREFIX = "Error parsing message"


def add_strict_service(server: grpc.aio.Server, servicer: object, service: ServiceDescriptor) -> None:
    """Serve every method of `service` from `servicer`, decoding requests in the handler."""
    handlers = {
        method.name: strict_method_handler(getattr(servicer, method.name), method) for method in service.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def decode_error_message(type_name: str, exc: DecodeError) -> str:
    """The INVALID_ARGUMENT details for a body that does not decode as `type_name`."""
    reason = str(exc)
    if reason.startswith(_PROTOBUF_PREFIX):
        reason = reason.split(": ", 1)[1] if ": " in reason else "malformed"
    return f"request: not a valid {type_name} message: {reason or 'malformed'}"


def strict_method_handler(behavior: Callable[..., Any], method: MethodDescriptor) -> grpc.RpcMethodHandler:
    """The handler of one method: raw bytes in, `behavior` called with the parsed message."""
    request_type = message_factory.GetMessageClass(method.input_type)
    response_type = message_factory.GetMessageClass(method.output_type)
    path = f"/{method.containing_service.full_name}/{method.name}"

    async def decode(raw: bytes, context: grpc.aio.ServicerContext) -> Message:
        try:
            return request_type.FromString(raw)
        except DecodeError as exc:
            details = decode_error_message(request_type.DESCRIPTOR.full_name, exc)
            log.warning("undecodable_request", method=path, bytes=len(raw), error=details)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, details)
            raise AssertionError("context.abort returned") from None  # pragma: no cover

    async def decoded_stream(
        raw_requests: AsyncIterable[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Message]:
        async for raw in raw_requests:
            yield await decode(raw, context)

    requests_of: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
    if method.client_streaming:

        async def stream_of(
            raw_requests: AsyncIterable[bytes], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Message]:
            return decoded_stream(raw_requests, context)

        requests_of = stream_of
    else:
        requests_of = decode

    kwargs = {"request_deserializer": None, "response_serializer": response_type.SerializeToString}
    if method.server_streaming:
        handler: Callable[..., Any]
        if inspect.isasyncgenfunction(behavior):

            async def stream(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
                request = await requests_of(request_or_iterator, context)
                # aclosing: a cancelled call closes the servicer's generator at once (its `finally` runs).
                async with aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response

            handler = stream
        else:  # a coroutine that answers with `await context.write(...)` (health Watch)

            async def written(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
                await behavior(await requests_of(request_or_iterator, context), context)

            handler = written
        if method.client_streaming:
            return grpc.stream_stream_rpc_method_handler(handler, **kwargs)
        return grpc.unary_stream_rpc_method_handler(handler, **kwargs)

    async def unary(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Message:
        return await behavior(await requests_of(request_or_iterator, context), context)

    if method.client_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
