"""Bearer tokens, the auth interceptor, TLS credentials and the bind policy, in-process."""

from __future__ import annotations

import asyncio
import hmac
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvserve.link.endpoint import is_loopback_host
from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.scheduler.server.security import auth
from kvserve.scheduler.server.security.auth import (
    BearerAuthInterceptor,
    TokenFileError,
    TokenTable,
    bearer_token,
    load_token_file,
)
from kvserve.scheduler.server.security.bind_policy import BindSecurity, InsecureBindError, check_bind
from kvserve.scheduler.server.security.tls import TlsConfigError, server_credentials, tls_files

pytestmark = pytest.mark.timeout(60)

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef00"


def _table() -> TokenTable:
    return TokenTable([(ALICE, "alice"), (BOB, "bob")])


# --- tokens -------------------------------------------------------------------------------


def test_tokens_map_to_their_tenant_and_nothing_else_matches() -> None:
    table = _table()
    assert table.tenant_for(ALICE) == "alice" and table.tenant_for(BOB) == "bob"
    for wrong in (None, "", ALICE[:-1], ALICE + "x", ALICE.upper(), " " + ALICE):
        assert table.tenant_for(wrong) is None, wrong


def test_every_entry_is_compared_whichever_matches(monkeypatch) -> None:
    calls: list[bytes] = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append(b)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    table = TokenTable([(f"token-{i:02d}-0123456789abcdef", f"t{i}") for i in range(10)])
    for presented in ("token-00-0123456789abcdef", "token-09-0123456789abcdef", "nope"):
        calls.clear()
        table.tenant_for(presented)
        assert len(calls) == 10, presented


def test_bearer_token_parsing() -> None:
    assert bearer_token([("authorization", f"Bearer {ALICE}")]) == ALICE
    assert bearer_token([("x-other", "1"), ("Authorization", f"bearer  {ALICE} ")]) == ALICE
    assert bearer_token([("authorization", f"Basic {ALICE}")]) is None
    assert bearer_token([("authorization", "Bearer ")]) is None
    assert bearer_token([]) is None and bearer_token(None) is None
    assert bearer_token([("authorization", f"Bearer {ALICE}".encode())]) == ALICE


def test_token_file_parsing(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"# operators' tokens\n\n{ALICE} alice\n{BOB}   bob\n")
    table = load_token_file(path)
    assert len(table) == 2 and table.tenants == {"alice", "bob"}
    assert table.tenant_for(BOB) == "bob"


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "no `TOKEN TENANT` lines"),
        ("# only a comment\n", "no `TOKEN TENANT` lines"),
        (f"{ALICE}\n", "expected `TOKEN TENANT`"),
        (f"{ALICE} alice extra\n", "expected `TOKEN TENANT`"),
        ("short alice\n", "at least 16 characters"),
        (f"{ALICE} alice\n{ALICE} bob\n", "duplicate token"),
        (f"{ALICE} team/alice\n", "tenant names"),
    ],
)
def test_bad_token_files_are_refused_with_the_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "tokens"
    path.write_text(content)
    with pytest.raises(TokenFileError, match=message):
        load_token_file(path)


def test_missing_token_file(tmp_path: Path) -> None:
    with pytest.raises(TokenFileError, match="cannot read"):
        load_token_file(tmp_path / "absent")


# --- the interceptor on a real grpc.aio server ----------------------------------------------


class _Servicer(api_pb2_grpc.KVServeServicer):
    async def ServerStats(self, request, context):
        return api_pb2.ServerStatsResponse(steps=7)

    async def Generate(self, request, context):
        for i in range(3):
            yield api_pb2.GenerateResponse(index=0, token_ids=[i])


async def _serve(interceptors, credentials=None) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=interceptors)
    api_pb2_grpc.add_KVServeServicer_to_server(_Servicer(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    return server, port


async def _outcomes(channel: grpc.aio.Channel, metadata) -> tuple[str, str, str]:
    stub = api_pb2_grpc.KVServeStub(channel)

    async def code_of(coro) -> str:
        try:
            await coro
            return "OK"
        except grpc.aio.AioRpcError as exc:
            return exc.code().name

    async def stream():
        return [c async for c in stub.Generate(api_pb2.GenerateRequest(text="x"), metadata=metadata, timeout=5)]

    unary = await code_of(stub.ServerStats(api_pb2.ServerStatsRequest(), metadata=metadata, timeout=5))
    streaming = await code_of(stream())
    probe = await code_of(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5))
    return unary, streaming, probe


@pytest.mark.parametrize(
    "metadata, expected",
    [
        ((("authorization", f"Bearer {ALICE}"),), ("OK", "OK", "OK")),
        ((), ("UNAUTHENTICATED", "UNAUTHENTICATED", "OK")),
        ((("authorization", "Bearer not-a-known-token-at-all"),), ("UNAUTHENTICATED", "UNAUTHENTICATED", "OK")),
        ((("authorization", ALICE),), ("UNAUTHENTICATED", "UNAUTHENTICATED", "OK")),
    ],
)
def test_interceptor_guards_kvserve_and_leaves_health_open(metadata, expected) -> None:
    async def scenario():
        server, port = await _serve([BearerAuthInterceptor(_table())])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await _outcomes(channel, metadata)
        finally:
            await server.stop(None)

    assert asyncio.run(scenario()) == expected


def test_open_methods() -> None:
    assert auth.is_open_method("/grpc.health.v1.Health/Check")
    assert auth.is_open_method("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
    assert not auth.is_open_method("/kvserve.v1.KVServe/Generate")
    assert not auth.is_open_method("/kvserve.v1.KVServe/ServerStats")


# --- TLS ------------------------------------------------------------------------------------


def make_self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A localhost certificate and key made with the openssl CLI (the test skips without it)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_tls_option_combinations(tmp_path: Path) -> None:
    assert tls_files(None, None) is None
    with pytest.raises(TlsConfigError, match="both"):
        tls_files(tmp_path / "c", None)
    with pytest.raises(TlsConfigError, match="--tls-client-ca needs"):
        tls_files(None, None, tmp_path / "ca")
    with pytest.raises(TlsConfigError, match="--tls-cert"):
        server_credentials(tls_files(tmp_path / "absent.pem", tmp_path / "absent.key"))
    (tmp_path / "junk.pem").write_text("not pem")
    with pytest.raises(TlsConfigError, match="not a PEM file"):
        server_credentials(tls_files(tmp_path / "junk.pem", tmp_path / "junk.pem"))


def test_tls_server_accepts_tls_clients_and_refuses_plaintext(tmp_path: Path) -> None:
    cert, key = make_self_signed(tmp_path)
    credentials = server_credentials(tls_files(cert, key))

    async def scenario():
        server, port = await _serve([], credentials)
        try:
            client = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
            async with grpc.aio.secure_channel(f"localhost:{port}", client) as channel:
                secure = await _outcomes(channel, ())
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                try:
                    await api_pb2_grpc.KVServeStub(channel).ServerStats(api_pb2.ServerStatsRequest(), timeout=2)
                    plain = "OK"
                except grpc.aio.AioRpcError as exc:
                    plain = exc.code().name
            return secure, plain
        finally:
            await server.stop(None)

    secure, plain = asyncio.run(scenario())
    assert secure == ("OK", "OK", "OK")
    assert plain != "OK"


# --- bind policy ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("example.com", False),
        ("", False),
    ],
)
def test_loopback_detection(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


def test_bind_policy() -> None:
    check_bind(BindSecurity(host="127.0.0.1", auth=False, tls=False))
    check_bind(BindSecurity(host="0.0.0.0", auth=True, tls=True))
    check_bind(BindSecurity(host="0.0.0.0", auth=True, tls=False))  # allowed, with a warning
    check_bind(BindSecurity(host="0.0.0.0", auth=False, tls=False, allow_insecure_remote=True))
    with pytest.raises(InsecureBindError, match="--auth-token-file"):
        check_bind(BindSecurity(host="0.0.0.0", auth=False, tls=True))
