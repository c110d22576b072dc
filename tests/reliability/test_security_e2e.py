"""Security of a running `kvserve serve`: bearer tokens, tenant isolation as paired
assertions, TLS, and the refusal to listen off loopback without authentication."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.testing.server_launcher import ServeProcess, start_serve
from kvserve.testing.stream_requests import collect, greedy_request
from tests.reliability.test_auth_unit import make_self_signed

pytestmark = pytest.mark.timeout(120)

ALICE = "alice-secret-token-000000000001"
BOB = "bob-secret-token-0000000000000002"
PROMPT_LEN = 96  # six full blocks: a repeat can hit five of them (one token is always computed)


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(f"# kvserve tokens\n{ALICE} alice\n{BOB} bob\n")
    return path


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Iterator[ServeProcess]:
    tmp_path = tmp_path_factory.mktemp("secured")
    process = start_serve(
        [
            "--executor",
            "fake",
            "--num-blocks",
            "1024",
            "--step-latency-ms",
            "5",
            "--auth-token-file",
            str(_token_file(tmp_path)),
        ],
        tmp_path,
    )
    process.metadata = _bearer(ALICE)
    try:
        process.wait_serving()
        yield process
    finally:
        process.stop()


def _cached_tokens(server: ServeProcess, token: str, key: int, salt: str = "") -> int:
    with server.channel() as channel:
        stub = api_pb2_grpc.KVServeStub(channel)
        request = greedy_request(key, 2, prompt_len=PROMPT_LEN, cache_salt=salt)
        chunks = list(stub.Generate(request, timeout=30, metadata=_bearer(token)))
    return chunks[-1].usage.cached_tokens


def test_tenant_isolation_paired(secured: ServeProcess) -> None:
    key = 11
    assert _cached_tokens(secured, ALICE, key) == 0
    assert _cached_tokens(secured, ALICE, key) > 0, "the same tenant must hit its own prefix"
    assert _cached_tokens(secured, BOB, key) == 0, "another tenant must never hit it"
    assert _cached_tokens(secured, BOB, key) > 0, "...while its own repeat does"


def test_cache_salt_only_subdivides_the_callers_tenant(secured: ServeProcess) -> None:
    key = 12
    assert _cached_tokens(secured, ALICE, key) == 0
    assert _cached_tokens(secured, ALICE, key, salt="project-x") == 0, "a salt is a separate space"
    assert _cached_tokens(secured, ALICE, key, salt="project-x") > 0
    # Bob cannot reach Alice's space by naming her tenant or her salt.
    for salt in ("", "alice", "project-x"):
        assert _cached_tokens(secured, BOB, key, salt=salt) == 0, salt


def _code(call) -> str:
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name


@pytest.mark.parametrize(
    "metadata",
    [(), _bearer("wrong-token-wrong-token-wrong"), (("authorization", ALICE),)],
    ids=["missing", "bad", "no-bearer-scheme"],
)
def test_every_api_method_refuses_missing_and_bad_tokens(secured: ServeProcess, metadata) -> None:
    with secured.channel() as channel:
        stub = api_pb2_grpc.KVServeStub(channel)
        calls = {
            "Generate": lambda: stub.Generate(greedy_request(1, 2), timeout=5, metadata=metadata),
            "Abort": lambda: stub.Abort(api_pb2.AbortRequest(request_id="x"), timeout=5, metadata=metadata),
            "Tokenize": lambda: stub.Tokenize(api_pb2.TokenizeRequest(text="hi"), timeout=5, metadata=metadata),
            "ModelInfo": lambda: stub.ModelInfo(api_pb2.ModelInfoRequest(), timeout=5, metadata=metadata),
            "ServerStats": lambda: stub.ServerStats(api_pb2.ServerStatsRequest(), timeout=5, metadata=metadata),
        }
        codes = {name: _code(call) for name, call in calls.items()}
        with_token = _code(lambda: stub.ModelInfo(api_pb2.ModelInfoRequest(), timeout=5, metadata=_bearer(BOB)))
    assert codes == dict.fromkeys(calls, "UNAUTHENTICATED")
    assert with_token == "OK"


def test_health_and_reflection_stay_open(secured: ServeProcess) -> None:
    assert secured.health() == health_pb2.HealthCheckResponse.SERVING
    with secured.channel() as channel:
        replies = list(
            reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
        )
    assert "kvserve.v1.KVServe" in {s.name for s in replies[0].list_services_response.service}


def test_request_ids_and_aborts_are_per_tenant(secured: ServeProcess) -> None:
    async def scenario():
        async with secured.aio_channel() as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            alices = stub.Generate(greedy_request(21, 200, request_id="job-1"), timeout=30, metadata=_bearer(ALICE))
            first = await alices.read()
            bob_abort = await stub.Abort(api_pb2.AbortRequest(request_id="job-1"), timeout=5, metadata=_bearer(BOB))
            bobs = await collect(stub, greedy_request(22, 3, request_id="job-1"), metadata=_bearer(BOB))
            rest = []
            while (chunk := await alices.read()) is not grpc.aio.EOF:
                rest.append(chunk)
            return first, bob_abort, bobs, rest

    first, bob_abort, (bob_ids, _), rest = asyncio.run(scenario())
    assert not bob_abort.found, "Bob must not see (or abort) Alice's request"
    assert len(bob_ids) == 3, "Bob may use the same request id as Alice"
    assert first.request_id == "job-1"
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 200
    assert rest[-1].finish_reason == api_pb2.FINISH_REASON_LENGTH


def test_tls_with_tokens(serve, tmp_path: Path) -> None:
    cert, key = make_self_signed(tmp_path)
    server = serve(
        [
            "--executor",
            "fake",
            "--num-blocks",
            "256",
            "--auth-token-file",
            str(_token_file(tmp_path)),
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
        ],
        wait=False,
    )
    server.credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    server.metadata = _bearer(ALICE)
    server.wait_serving()
    assert server.stats().num_blocks == 256
    with grpc.insecure_channel(server.address) as plain:
        assert (
            _code(
                lambda: api_pb2_grpc.KVServeStub(plain).ServerStats(
                    api_pb2.ServerStatsRequest(), timeout=3, metadata=_bearer(ALICE)
                )
            )
            == "UNAVAILABLE"
        )


def _run_serve(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvserve", "serve", "--executor", "fake", "--port", "0", "--http-port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )


def test_non_loopback_without_auth_is_refused_before_anything_starts(tmp_path: Path) -> None:
    result = _run_serve(["--host", "0.0.0.0"], tmp_path)
    assert result.returncode == 2
    assert "--auth-token-file" in result.stderr and "--allow-insecure-remote" in result.stderr
    assert "executor_started" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--auth-token-file", "/nonexistent/tokens"], "cannot read the token file"),
        (["--tls-cert", "/nonexistent/cert.pem"], "--tls-key"),
        (["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"], "--tls-cert"),
    ],
)
def test_bad_security_options_fail_fast_with_one_clear_error(tmp_path: Path, args, message) -> None:
    result = _run_serve(args, tmp_path)
    assert result.returncode == 2
    assert message in result.stderr


def test_curve_link_admits_only_the_listed_executor(tmp_path: Path) -> None:
    import zmq.auth

    from kvserve.testing.ports import free_port

    keys = {name: zmq.auth.create_certificates(tmp_path, name) for name in ("scheduler", "executor", "intruder")}
    link = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    logs = {name: tmp_path / f"{name}.log" for name in ("scheduler", "executor", "intruder", "plain")}

    def spawn(name: str, argv: list[str]) -> subprocess.Popen:
        with open(logs[name], "wb") as log_file:
            return subprocess.Popen(
                [sys.executable, "-m", "kvserve", *argv],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def executor(name: str, curve: list[str]) -> subprocess.Popen:
        return spawn(
            name,
            [
                "executor",
                "--executor",
                "fake",
                "--num-blocks",
                "128",
                "--link",
                link,
                "--connect-timeout-s",
                "3",
                *curve,
            ],
        )

    processes = [
        spawn(
            "scheduler",
            [
                "scheduler",
                "--port",
                str(port),
                "--http-port",
                "0",
                "--link",
                link,
                "--curve-secret-key",
                str(keys["scheduler"][1]),
                "--curve-executor-key",
                str(keys["executor"][0]),
            ],
        )
    ]
    try:
        processes.append(
            executor(
                "executor",
                ["--curve-secret-key", str(keys["executor"][1]), "--curve-server-key", str(keys["scheduler"][0])],
            )
        )
        server = ServeProcess(process=processes[0], port=port, log_path=logs["scheduler"])
        server.wait_serving()
        intruders = [
            executor(
                "intruder",
                ["--curve-secret-key", str(keys["intruder"][1]), "--curve-server-key", str(keys["scheduler"][0])],
            ),
            executor("plain", []),
        ]
        processes += intruders
        assert [p.wait(20) for p in intruders] == [4, 4]  # ExitReason.NEVER_CONNECTED
        assert len(server.log_events("executor registered")) == 1  # never replaced by an intruder
        assert server.stats().executor_restarts == 0

        async def generate():
            async with server.aio_channel() as channel:
                return await collect(api_pb2_grpc.KVServeStub(channel), greedy_request(3, 4))

        assert len(asyncio.run(generate())[0]) == 4
    finally:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(10)


def test_unreadable_curve_key_fails_fast(tmp_path: Path) -> None:
    result = _run_serve(["--curve-secret-key", str(tmp_path / "absent.key_secret")], tmp_path)
    assert result.returncode == 2 and "CURVE keys" in result.stderr
