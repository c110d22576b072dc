"""What every HTTP route shares with the rest of the service: the model, tokens, metrics, names.

The gRPC servicer and the HTTP app read the same `ServingModel` (set once the first
executor registered) through `model`, so both APIs reach one engine, one tokenizer and
one prefix cache. Authentication is the gRPC API's token table: `Authorization: Bearer
TOKEN` names the tenant, and with it the prefix namespace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog
from fastapi import Request

from kvserve.scheduler.server.http.errors import ApiError, model_not_found
from kvserve.scheduler.server.intake.served_models import ModelNotFound
from kvserve.scheduler.server.observability.metrics import ServerMetrics
from kvserve.scheduler.server.security.auth import TokenTable, bearer_token
from kvserve.scheduler.server.security.namespaces import ANONYMOUS_TENANT
from kvserve.scheduler.server.serving_model import ServingModel

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class HttpContext:
    model_source: Callable[[], ServingModel | None]
    tokens: TokenTable | None
    metrics: ServerMetrics
    max_request_bytes: int
    draining: bool = False
    admins: frozenset[str] = frozenset()
    """The tenants with admin rights (`--admin-tenant`), when tokens are on."""

    def authenticate(self, request: Request) -> str:
        """The caller's tenant; 401 without a valid bearer token when auth is on."""
        if self.tokens is None:
            return ANONYMOUS_TENANT
        token = bearer_token(request.headers.items())
        tenant = self.tokens.tenant_for(token)
        if tenant is not None:
            return tenant
        why = "missing bearer token" if token is None else "invalid bearer token"
        log.warning("unauthenticated_call", method=f"{request.method} {request.url.path}", reason=why)
        raise ApiError(
            401, f"{why}: send `Authorization: Bearer TOKEN`", type="invalid_request_error", code="invalid_api_key"
        )

    def require_admin(self, request: Request) -> str:
        """The caller's tenant when it may administer the server (anyone without tokens); 401 or 403."""
        tenant = self.authenticate(request)
        if self.tokens is not None and tenant not in self.admins:
            log.warning("admin_call_refused", method=f"{request.method} {request.url.path}", tenant=tenant)
            raise ApiError(
                403,
                f"tenant {tenant!r} may not {request.url.path.rsplit('/', 1)[-1].replace('_', ' ')}: "
                "admin tenants only (--admin-tenant)",
                type="permission_denied",
                code="permission_denied",
            )
        return tenant

    def require_model(self) -> ServingModel:
        model = self.model_source()
        if model is None:
            raise ApiError(
                503, "no executor has registered yet", type="service_unavailable", code="service_unavailable"
            )
        return model

    def resolve_model(self, name: str | None, model: ServingModel) -> str:
        """The `model` a request named (the served id when omitted); 404 `model_not_found` for a name that is
        neither the base model's nor an adapter's. Generation requests are checked by `parse_generate`."""
        try:
            model.limits.models.resolve(name or "")
        except ModelNotFound as exc:
            raise model_not_found(exc) from None
        return name or model.limits.models.base_id
