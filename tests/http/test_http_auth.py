"""Bearer tokens on the HTTP API: the gRPC API's token table, tenants and prefix namespaces, and bind policy."""

from __future__ import annotations

import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.testing.server_launcher import ServeProcess, start_serve
from tests.http.http_clients import ALICE, BOB, FAKE_ARGS, sdk, token_file

SYSTEM = "You are a careful assistant. " * 12  # several full KV blocks: enough for the prefix cache to hold


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    tokens = token_file(tmp_path_factory.mktemp("tokens"))
    server = start_serve([*FAKE_ARGS, "--auth-token-file", str(tokens)], http=True)
    server.metadata = (("authorization", f"Bearer {ALICE}"),)
    try:
        server.wait_serving()
        yield server
    finally:
        server.stop()


def chat(server: ServeProcess, token: str, question: str) -> openai.types.chat.ChatCompletion:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return sdk(server, api_key=token).chat.completions.create(
        model="fake:smollm2-135m-instruct", messages=messages, max_tokens=3
    )


def test_missing_or_wrong_token_is_unauthenticated(auth_server: ServeProcess) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        sdk(auth_server, api_key="wrong-token-wrong-token-wrong").models.list()
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    assert info.value.body["message"].startswith("invalid bearer token")
    for path in ("/v1/models", "/metrics", "/version"):
        response = httpx.get(f"{auth_server.http_url}{path}")  # no Authorization header at all
        assert response.status_code == 401, path
        assert response.json()["error"]["message"].startswith("missing bearer token")
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    refused = httpx.post(f"{auth_server.http_url}/v1/completions", json={"prompt": "x"})
    assert refused.status_code == 401


def test_health_and_ready_are_open_the_rest_needs_the_token(auth_server: ServeProcess) -> None:
    assert httpx.get(f"{auth_server.http_url}/health").status_code == 200
    assert httpx.get(f"{auth_server.http_url}/ready", timeout=30).status_code == 200
    headers = {"Authorization": f"Bearer {BOB}"}
    metrics = httpx.get(f"{auth_server.http_url}/metrics", headers=headers)
    assert metrics.status_code == 200 and "kvserve:num_requests_running" in metrics.text
    assert httpx.get(f"{auth_server.http_url}/version", headers=headers).json()["version"]


def test_cached_tokens_per_tenant_shared_with_grpc(auth_server: ServeProcess) -> None:
    first = chat(auth_server, ALICE, "What is 2 + 2?")
    again = chat(auth_server, ALICE, "What is 3 + 3?")
    other = chat(auth_server, BOB, "What is 2 + 2?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0, again.usage
    assert other.usage.prompt_tokens_details.cached_tokens == 0, "tenants must never share KV"
    # The gRPC API with Alice's token reaches the same namespace.
    messages = [api_pb2.ChatMessage(role="system", content=SYSTEM), api_pb2.ChatMessage(role="user", content="Hi")]
    request = api_pb2.GenerateRequest(
        chat=api_pb2.ChatPrompt(messages=messages), sampling=api_pb2.SamplingParams(max_tokens=2)
    )
    with grpc.insecure_channel(auth_server.address) as channel:
        chunks = list(api_pb2_grpc.KVServeStub(channel).Generate(request, timeout=30, metadata=auth_server.metadata))
    cached = [c.usage.cached_tokens for c in chunks if c.HasField("usage")]
    assert cached and cached[0] > 0


def test_a_remote_http_host_needs_auth(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvserve", "serve", "--executor", "fake", "--port", "0", "--http-host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "0.0.0.0" in result.stderr and "--allow-insecure-remote" in result.stderr
    assert "executor_started" not in result.stderr + result.stdout


def test_http_uses_the_grpc_tls_files(http_serve_factory, tmp_path: Path) -> None:
    from tests.reliability.test_auth_unit import make_self_signed

    cert, key = make_self_signed(tmp_path)
    tokens = token_file(tmp_path)
    server = http_serve_factory(
        [*FAKE_ARGS, "--auth-token-file", str(tokens), "--tls-cert", str(cert), "--tls-key", str(key)], wait=False
    )
    server.credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    server.wait_serving()
    url = f"https://{server.http_address}"
    trust = ssl.create_default_context(cafile=str(cert))
    assert httpx.get(f"{url}/health", verify=trust).status_code == 200
    models = httpx.get(f"{url}/v1/models", verify=trust, headers={"Authorization": f"Bearer {ALICE}"})
    assert models.status_code == 200 and models.json()["data"]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{server.http_url}/health", timeout=5)  # plain HTTP to a TLS listener
    assert f"OpenAI HTTP {url}/v1" in server.log_text()
