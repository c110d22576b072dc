"""Bearer-token authentication for the gRPC API: token -> tenant.

The token file maps secrets to tenants, one `TOKEN TENANT` pair per line (blank lines
and `#` comments ignored). A call sends `authorization: Bearer TOKEN`; the tenant it
maps to names the caller's prefix-cache namespace, so tenants never share KV.

Tokens are compared with `hmac.compare_digest` against *every* entry, with no early
exit, so the time a check takes does not reveal how much of a token was right or which
entry matched. Health checking and server reflection stay open (orchestrators probe
them without secrets); every KVServe method needs a valid token and otherwise ends
with UNAUTHENTICATED before the servicer sees it.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

log = structlog.get_logger(__name__)

AUTH_METADATA_KEY = "authorization"
BEARER_PREFIX = "bearer "
OPEN_SERVICE_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""Methods callable without a token: liveness probes and schema discovery reveal nothing private."""
MIN_TOKEN_CHARS = 16
"""Shorter tokens are refused when the file is loaded: they could be guessed."""
TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""Tenant names appear in logs and scope request ids as `tenant/id`, so they hold no `/`."""


class TokenFileError(ValueError):
    """The token file is missing, unreadable or malformed; the message says where."""


@dataclass(slots=True, frozen=True)
class _Entry:
    token: bytes
    tenant: str


class TokenTable:
    """The known tokens; `tenant_for` resolves a presented token in constant time."""

    def __init__(self, pairs: Iterable[tuple[str, str]]) -> None:
        entries = [_Entry(token.encode("utf-8"), tenant) for token, tenant in pairs]
        if not entries:
            raise TokenFileError("the token table is empty: no caller could ever authenticate")
        self._entries = tuple(entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(e.tenant for e in self._entries)

    def tenant_for(self, token: str | bytes | None) -> str | None:
        """The tenant of `token`, or None. Every entry is compared, whatever matches."""
        if token is None:
            return None
        presented = token.encode("utf-8") if isinstance(token, str) else bytes(token)
        found: str | None = None
        for entry in self._entries:
            if hmac.compare_digest(presented, entry.token) and found is None:
                found = entry.tenant
        return found

    def tenant_from_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """The tenant of the call's `authorization: Bearer TOKEN` metadata, or None."""
        return self.tenant_for(bearer_token(metadata))


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of the first `authorization` entry if it uses the Bearer scheme."""
    for key, value in metadata or ():
        if key.lower() != AUTH_METADATA_KEY:
            continue
        text = value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value
        if text[: len(BEARER_PREFIX)].lower() != BEARER_PREFIX:
            return None
        return text[len(BEARER_PREFIX) :].strip() or None
    return None


def load_token_file(path: str | Path) -> TokenTable:
    """Parse `TOKEN TENANT` lines; refuse duplicates, short tokens and empty files."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TokenFileError(f"cannot read the token file {path}: {exc.strerror or exc}") from exc
    pairs: list[tuple[str, str]] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenFileError(f"{path}:{number}: expected `TOKEN TENANT`, got {len(parts)} fields")
        token, tenant = parts
        if not TENANT_NAME.fullmatch(tenant):
            raise TokenFileError(f"{path}:{number}: tenant names are 1-64 of A-Z a-z 0-9 _ . -")
        if len(token) < MIN_TOKEN_CHARS:
            raise TokenFileError(f"{path}:{number}: tokens must be at least {MIN_TOKEN_CHARS} characters")
        if token in seen:
            raise TokenFileError(f"{path}:{number}: duplicate token")
        seen.add(token)
        pairs.append((token, tenant))
    if not pairs:
        raise TokenFileError(f"{path}: no `TOKEN TENANT` lines; no caller could ever authenticate")
    return TokenTable(pairs)


def is_open_method(method: str) -> bool:
    """Whether a full method name (`/package.Service/Method`) is callable without a token."""
    return method.startswith(OPEN_SERVICE_PREFIXES)


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuse every non-open method whose caller has no valid token, with UNAUTHENTICATED."""

    def __init__(self, table: TokenTable) -> None:
        self.table = table

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or is_open_method(handler_call_details.method):
            return handler
        metadata = handler_call_details.invocation_metadata
        token = bearer_token(metadata)
        if self.table.tenant_for(token) is not None:
            return handler
        why = "missing bearer token" if token is None else "invalid bearer token"
        log.warning("unauthenticated_call", method=handler_call_details.method, reason=why)
        return _refusing_handler(handler, f"{why}: send `authorization: Bearer TOKEN` metadata")


def _refusing_handler(like: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `like` that ends the call with UNAUTHENTICATED."""

    async def refuse(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as a streaming handler must be

    kwargs = {"request_deserializer": like.request_deserializer, "response_serializer": like.response_serializer}
    if like.request_streaming and like.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, **kwargs)
    if like.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    if like.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
