"""A web page cannot drive a local server without a token: JSON bodies only, loopback Hosts only,
CORS only where opted in. Raw HTTP (http.client), so each header is exactly what a browser could send."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from kvserve.scheduler.server.http.browser_policy import BrowserPolicy, BrowserPolicyError
from kvserve.testing.server_launcher import ServeProcess
from tests.http.http_clients import ALICE, FAKE_ARGS, token_file

BODY = json.dumps({"model": None, "prompt": "a b c", "max_tokens": 2}).encode()


def _request(
    server: ServeProcess,
    method: str,
    path: str,
    *,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], dict]:
    """(status, headers lower-cased, the JSON body or {}) of one request with exactly `headers`
    (`Host` included when given: http.client then sends no Host of its own)."""
    url = urlsplit(server.http_url)
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
    try:
        headers = dict(headers or {})
        connection.putrequest(method, path, skip_host="Host" in headers, skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        if body is not None:
            connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        raw = response.read()
        answer_headers = {k.lower(): v for k, v in response.getheaders()}
        is_json = answer_headers.get("content-type", "").startswith("application/json")
        return response.status, answer_headers, json.loads(raw) if is_json else {}
    finally:
        connection.close()


def _completion(server: ServeProcess, content_type: str | None, **headers: str) -> tuple[int, dict]:
    if content_type is not None:
        headers["Content-Type"] = content_type
    status, _, body = _request(server, "POST", "/v1/completions", body=BODY, headers=headers)
    return status, body


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonp",
        None,
    ],
)
def test_a_body_not_sent_as_json_is_refused_with_415(http_server: ServeProcess, content_type: str | None) -> None:
    status, body = _completion(http_server, content_type)
    assert status == 415, body
    error = body["error"]
    assert error["code"] == "unsupported_media_type" and "Content-Type: application/json" in error["message"]
    for path in ("/tokenize", "/detokenize", "/v1/chat/completions"):  # every POST route
        status, _, other = _request(http_server, "POST", path, body=b"{}", headers={"Content-Type": "text/plain"})
        assert status == 415, (path, other)


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
def test_json_content_types_are_served(http_server: ServeProcess, content_type: str) -> None:
    status, body = _completion(http_server, content_type)
    assert status == 200, body
    assert body["choices"][0]["text"] is not None


def test_a_rebinding_host_is_refused_and_loopback_names_pass(http_server: ServeProcess) -> None:
    port = urlsplit(http_server.http_url).port
    for host in (f"attacker.example:{port}", "attacker.example", f"192.168.1.20:{port}", "localhost.attacker.example"):
        for method, path, body in (
            ("POST", "/v1/completions", BODY),
            ("GET", "/v1/models", None),
            ("GET", "/health", None),
        ):
            status, _, answer = _request(
                http_server, method, path, body=body, headers={"Host": host, "Content-Type": "application/json"}
            )
            assert status == 403, (host, path, answer)
            assert answer["error"]["code"] == "host_not_allowed"
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST", f"127.0.0.2:{port}"):
        assert _completion(http_server, "application/json", Host=host)[0] == 200, host
    status, _, _ = _request(http_server, "GET", "/health", headers={"Host": ""})  # an empty Host names nothing
    assert status == 403


def test_allowed_hosts_extend_the_loopback_names(http_serve_factory) -> None:
    server = http_serve_factory([*FAKE_ARGS, "--allowed-hosts", "kvserve.internal"])
    assert _completion(server, "application/json", Host="kvserve.internal:8000")[0] == 200
    assert _completion(server, "application/json", Host="other.internal")[0] == 403


def test_with_auth_on_the_host_check_is_off_and_the_token_decides(http_serve_factory, tmp_path: Path) -> None:
    server = http_serve_factory([*FAKE_ARGS, "--auth-token-file", str(token_file(tmp_path))])
    assert _completion(server, "application/json", Host="api.example.com")[0] == 401
    authorized = {"Host": "api.example.com", "Authorization": f"Bearer {ALICE}"}
    assert _completion(server, "application/json", **authorized)[0] == 200


def _preflight(server: ServeProcess, origin: str) -> dict[str, str]:
    status, headers, _ = _request(
        server,
        "OPTIONS",
        "/v1/chat/completions",
        headers={
            "Host": urlsplit(server.http_url).netloc,
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    return {"status": str(status), **headers}


def test_cors_is_off_by_default_and_opted_in_per_origin(http_server: ServeProcess, http_serve_factory) -> None:
    assert "access-control-allow-origin" not in _preflight(http_server, "http://app.example")
    server = http_serve_factory([*FAKE_ARGS, "--cors-origin", "http://app.example"])
    allowed = _preflight(server, "http://app.example")
    assert allowed["status"] == "200" and allowed["access-control-allow-origin"] == "http://app.example"
    assert "access-control-allow-origin" not in _preflight(server, "http://elsewhere.example")


def test_a_wildcard_cors_origin_without_auth_is_refused_at_start(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvserve", "serve", "--executor", "fake", "--port", "0", "--cors-origin", "*"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "--cors-origin '*' needs --auth-token-file" in result.stderr
    assert "Traceback" not in result.stderr


def test_policy_host_names() -> None:
    policy = BrowserPolicy(auth=False, listen_host="10.0.0.5", allowed_hosts=("Box.Lan",))
    for host in ("localhost:1", "127.0.0.1", "[::1]:80", "::1", "10.0.0.5:8000", "box.lan:1"):
        assert policy.host_allowed(host), host
    for host in ("", None, "10.0.0.6", "[::2]:80", "box.lan.evil:1", "0.0.0.0:8000"):
        assert not policy.host_allowed(host), host
    assert BrowserPolicy(auth=False, listen_host="127.0.0.1", allowed_hosts=("*",)).host_allowed("x.example")
    assert not BrowserPolicy(auth=False, listen_host="0.0.0.0").host_allowed("0.0.0.0:8000")  # a wildcard bind
    with pytest.raises(BrowserPolicyError, match="scheme://host"):
        BrowserPolicy(auth=True, listen_host="127.0.0.1", cors_origins=("app.example",)).check()
    BrowserPolicy(auth=True, listen_host="127.0.0.1", cors_origins=("*",)).check()
