"""What a web browser may do with the HTTP API: the defences of a server that runs without a token.

A local `kvserve serve` without `--auth-token-file` answers whoever reaches its loopback port,
and a browser on the same machine reaches it from any page the user opens. Three rules keep a
page from driving it:

- **Only `application/json` bodies** (`require_json_content_type`). A page may POST
  `text/plain` or a form cross-origin with no CORS preflight; a JSON body sent that way would
  otherwise make the server generate at the page's request. Anything else is a 415.
- **Only loopback `Host` names while auth is off** (`HostGuard`). A DNS-rebinding page (its
  own domain, resolving to 127.0.0.1) is same-origin with the server in the browser's eyes, so
  it could read the answers; its requests carry its domain in `Host`, which is refused with a
  403. Loopback names and addresses and the configured `--http-host` pass, as does each
  `--allowed-hosts` entry (`*`: any). This is Jupyter's policy. With tokens on, a page holds no
  token, so the check is off.
- **No CORS unless asked** (`cors_middleware`): `--cors-origin ORIGIN` opts an origin in, and
  `*` only with auth on.

`HostGuard` is plain ASGI, not Starlette's `BaseHTTPMiddleware`, which would break the
streaming routes' disconnect detection.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fastapi import Request
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.link.endpoint import is_loopback_host
from kvserve.scheduler.server.http.errors import ApiError, error_response

JSON_MEDIA_TYPE = "application/json"
ANY_HOST = "*"
_WILDCARDS = frozenset({"0.0.0.0", "::", "[::]", ""})


class BrowserPolicyError(ValueError):
    """The CORS or Host options contradict the server's security (exit code 2 at start)."""


@dataclass(frozen=True, slots=True)
class BrowserPolicy:
    """The options behind the three rules, checked once at start (`check`)."""

    auth: bool
    listen_host: str
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()

    def check(self) -> None:
        if ANY_HOST in self.cors_origins and not self.auth:
            raise BrowserPolicyError(
                "--cors-origin '*' needs --auth-token-file: without a token any web page could use the server; "
                "name the origins that may (e.g. --cors-origin http://localhost:3000)"
            )
        for origin in self.cors_origins:
            if origin != ANY_HOST and "://" not in origin:
                raise BrowserPolicyError(f"--cors-origin {origin!r}: expected scheme://host[:port], or '*'")

    def host_allowed(self, host_header: str | None) -> bool:
        """Whether a request with this `Host` header may reach the API."""
        if self.auth or ANY_HOST in self.allowed_hosts:
            return True
        name = _host_name(host_header or "")
        if not name:
            return False
        listen = () if self.listen_host in _WILDCARDS else (self.listen_host,)  # every address names none
        allowed = {_host_name(h) for h in (*listen, *self.allowed_hosts)}
        return is_loopback_host(name) or name in allowed


def _host_name(host: str) -> str:
    """The name of a `Host` value without its port: `[::1]:8000` -> `::1`, `Example.com:80` -> `example.com`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:  # name:port; more colons is a bare IPv6 address
        return host.split(":", 1)[0]
    return host


def require_json_content_type(request: Request) -> None:
    """415 unless the request says its body is JSON (`application/json`, parameters such as charset allowed)."""
    content_type = request.headers.get("content-type")
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        given = "no Content-Type" if content_type is None else f"Content-Type {content_type[:100]!r}"
        raise ApiError(
            415,
            f"the request body must be JSON sent as Content-Type: {JSON_MEDIA_TYPE}; got {given}",
            code="unsupported_media_type",
        )


class HostGuard:
    """ASGI middleware: 403 for HTTP requests whose `Host` the policy refuses; everything else passes."""

    def __init__(self, app: ASGIApp, policy: BrowserPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.policy.host_allowed(_header(scope, b"host")):
            await error_response(_HOST_REFUSED)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def cors_middleware(app: ASGIApp, origins: Iterable[str]) -> ASGIApp:
    """Starlette's CORS middleware for the opted-in origins; the app unchanged when there are none."""
    origins = list(origins)
    if not origins:
        return app
    return CORSMiddleware(
        app,
        allow_origins=origins,
        allow_methods=["GET", "POST"],
        allow_headers=["authorization", "content-type"],
    )


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


_HOST_REFUSED = ApiError(
    403,
    "this Host is not allowed while the server runs without authentication: use localhost or 127.0.0.1, "
    "or start the server with --allowed-hosts NAME or --auth-token-file",
    code="host_not_allowed",
)
