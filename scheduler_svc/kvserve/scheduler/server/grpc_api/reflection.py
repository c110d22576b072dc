"""Server reflection: `grpc.reflection.v1alpha` (grpcio-reflection) and the standard v1 beside it.

grpcio-reflection ships only v1alpha, while current clients (grpcurl, Postman, grpcui) ask
for `grpc.reflection.v1.ServerReflection` first. The two packages define the same
messages, field for field (protos/grpc/reflection/v1/reflection.proto), so the v1 service
is the v1alpha implementation with each message re-encoded: a v1 request's bytes parse
as its v1alpha twin, and the v1alpha answer's bytes parse as the v1 response.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable
from contextlib import aclosing

import grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

from kvserve.protos.grpc.reflection.v1 import reflection_pb2 as v1_pb2
from kvserve.scheduler.server.grpc_api.strict_handlers import add_strict_service

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
V1_SERVICE_NAME = v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name


class ReflectionV1Servicer:
    """`grpc.reflection.v1.ServerReflection`, answered by a v1alpha servicer."""

    def __init__(self, v1alpha: reflection.aio.ReflectionServicer) -> None:
        self._v1alpha = v1alpha

    async def ServerReflectionInfo(
        self, request_iterator: AsyncIterable[v1_pb2.ServerReflectionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[v1_pb2.ServerReflectionResponse]:
        async def as_v1alpha() -> AsyncIterator[v1alpha_pb2.ServerReflectionRequest]:
            async for request in request_iterator:
                yield v1alpha_pb2.ServerReflectionRequest.FromString(request.SerializeToString())

        async with aclosing(self._v1alpha.ServerReflectionInfo(as_v1alpha(), context)) as responses:
            async for response in responses:
                yield v1_pb2.ServerReflectionResponse.FromString(response.SerializeToString())


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> tuple[str, ...]:
    """Serve reflection v1alpha and v1 for `service_names` (both reflection services are added
    to the listing); return every name listed."""
    names = (*service_names, V1ALPHA_SERVICE_NAME, V1_SERVICE_NAME)
    v1alpha = reflection.aio.ReflectionServicer(names)
    add_strict_service(server, v1alpha, v1alpha_pb2.DESCRIPTOR.services_by_name["ServerReflection"])
    add_strict_service(server, ReflectionV1Servicer(v1alpha), v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"])
    return names
