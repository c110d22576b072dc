"""Server reflection answers over the standard v1 and the older v1alpha, with the same content."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_grpc

from kvserve.protos.grpc.reflection.v1 import reflection_pb2 as v1_pb2
from kvserve.protos.grpc.reflection.v1 import reflection_pb2_grpc as v1_grpc

VERSIONS = {"v1": (v1_pb2, v1_grpc), "v1alpha": (v1alpha_pb2, v1alpha_grpc)}
EXPECTED_SERVICES = {
    "kvserve.v1.KVServe",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
}
KVSERVE_METHODS = {
    "Generate",
    "Abort",
    "Tokenize",
    "ModelInfo",
    "ServerStats",
    "LoadLoraAdapter",
    "UnloadLoraAdapter",
}


def _ask(server, version: str, **request_fields) -> list:
    """One reflection stream carrying one request per keyword dict; returns the responses."""
    pb2, pb2_grpc = VERSIONS[version]
    requests = [pb2.ServerReflectionRequest(**fields) for fields in request_fields["requests"]]
    with server.channel() as channel:
        return list(pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter(requests), timeout=10))


def _file(blob: bytes) -> descriptor_pb2.FileDescriptorProto:
    return descriptor_pb2.FileDescriptorProto.FromString(blob)


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_list_services(fake_server, version: str) -> None:
    (response,) = _ask(fake_server, version, requests=[{"list_services": ""}])
    assert response.WhichOneof("message_response") == "list_services_response"
    assert {s.name for s in response.list_services_response.service} == EXPECTED_SERVICES
    assert response.original_request.HasField("list_services")


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_describe_kvserve(fake_server, version: str) -> None:
    by_service, by_message, by_name = _ask(
        fake_server,
        version,
        requests=[
            {"file_containing_symbol": "kvserve.v1.KVServe"},
            {"file_containing_symbol": "kvserve.v1.GenerateRequest"},
            {"file_by_filename": "kvserve/protos/kvserve/v1/api.proto"},
        ],
    )
    for response in (by_service, by_message, by_name):
        assert response.WhichOneof("message_response") == "file_descriptor_response", response
        files = [_file(b) for b in response.file_descriptor_response.file_descriptor_proto]
        (api,) = [f for f in files if f.name == "kvserve/protos/kvserve/v1/api.proto"]
        assert api.package == "kvserve.v1"
        (service,) = [s for s in api.service if s.name == "KVServe"]
        assert {m.name for m in service.method} == KVSERVE_METHODS
        generate = next(m for m in service.method if m.name == "Generate")
        assert generate.input_type == ".kvserve.v1.GenerateRequest" and generate.server_streaming


def test_v1_describes_itself(fake_server) -> None:
    (response,) = _ask(fake_server, "v1", requests=[{"file_containing_symbol": "grpc.reflection.v1.ServerReflection"}])
    (own,) = [_file(b) for b in response.file_descriptor_response.file_descriptor_proto]
    assert own.package == "grpc.reflection.v1" and own.service[0].name == "ServerReflection"


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_unknown_symbol_is_an_error_response_not_a_failed_call(fake_server, version: str) -> None:
    missing, listing = _ask(
        fake_server, version, requests=[{"file_containing_symbol": "no.such.Service"}, {"list_services": ""}]
    )
    assert missing.WhichOneof("message_response") == "error_response"
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert listing.WhichOneof("message_response") == "list_services_response"  # the stream goes on


def test_v1_and_v1alpha_answer_byte_for_byte_alike(fake_server) -> None:
    """Same schema, same implementation: the two versions' answers encode to the same bytes."""
    requests = [
        {"list_services": ""},
        {"file_containing_symbol": "kvserve.v1.GenerateRequest"},
        {"file_by_filename": "kvserve/protos/kvserve/v1/api.proto"},
        {"file_containing_symbol": "nope"},
        {"all_extension_numbers_of_type": "kvserve.v1.GenerateRequest"},
    ]
    v1 = [r.SerializeToString() for r in _ask(fake_server, "v1", requests=requests)]
    v1alpha = [r.SerializeToString() for r in _ask(fake_server, "v1alpha", requests=requests)]
    assert len(v1) == len(requests) and v1 == v1alpha
