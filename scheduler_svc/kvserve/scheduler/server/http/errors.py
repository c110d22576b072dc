"""OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`, for every failure.

Clients written against OpenAI (the official SDKs among them) pick their exception from
the HTTP status and read `error.message` and `error.param`; so every refusal, including
FastAPI's own (unknown route, wrong method, validation), leaves in this one shape. Only
an unexpected exception is a 500 with a traceback in the log; the client sees no details.
"""

from __future__ import annotations

from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.scheduler.server.delivery.request_stream import FailureKind, RequestFailed
from kvserve.scheduler.server.intake.served_models import ModelNotFound

log = structlog.get_logger(__name__)

INVALID_REQUEST = "invalid_request_error"

_FAILURES: dict[FailureKind, tuple[int, str, str]] = {
    FailureKind.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    FailureKind.UNAVAILABLE: (503, "service_unavailable", "service_unavailable"),
    FailureKind.INTERNAL: (500, "server_error", "internal_error"),
}
_STATUS_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


class ApiError(Exception):
    """A refusal with its HTTP status and OpenAI error fields; `param` is the OpenAI field name."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_field(param: str | None, message: str, *, code: str = "invalid_value") -> ApiError:
    """A 400 naming the OpenAI field: `param: message`, as the gRPC API words it."""
    text = f"{param}: {message}" if param else message
    return ApiError(400, text, param=param, code=code)


def unsupported(param: str, why: str) -> ApiError:
    return bad_field(param, f"not supported by kvserve ({why})", code="unsupported_parameter")


def model_not_found(exc: ModelNotFound) -> ApiError:
    """A `model` that is neither the served model (nor an alias) nor one of its LoRA adapters: 404, as OpenAI."""
    return ApiError(404, exc.reason, param="model", code="model_not_found")


def from_failure(exc: RequestFailed) -> ApiError:
    """The engine's failure kinds: queue full 429, no executor or draining 503, executor failure 500."""
    status, kind, code = _FAILURES[exc.kind]
    return ApiError(status, exc.message, type=kind, code=code)


def error_response(exc: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception the app can raise to the OpenAI shape."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def on_http_exception(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        code = _STATUS_CODES.get(exc.status_code)
        return error_response(ApiError(exc.status_code, message, code=code))

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return error_response(bad_field(where, str(first.get("msg", "invalid request"))))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("http_internal_error", path=request.url.path)
        return error_response(ApiError(500, "internal server error", type="server_error", code="internal_error"))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)
