"""The FastAPI application: the OpenAI routes, the service routes, and OpenAI-shaped errors.

No interactive docs or OpenAPI schema (they would be open routes describing a private
server). Auth is a call at the top of each protected route; the only middleware is plain ASGI
(the Host check and, when opted in, CORS: browser_policy.py), since Starlette's base middleware
would break disconnect detection of streams.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.types import ASGIApp

from kvserve.scheduler.server.engine_view.hub import ViewHub
from kvserve.scheduler.server.http.browser_policy import BrowserPolicy, HostGuard, cors_middleware
from kvserve.scheduler.server.http.context import HttpContext
from kvserve.scheduler.server.http.errors import install_error_handlers
from kvserve.scheduler.server.http.lora_routes import lora_router
from kvserve.scheduler.server.http.openai_routes import openai_router
from kvserve.scheduler.server.http.service_routes import kvserve_version, service_router
from kvserve.scheduler.server.http.ui_routes import UiOptions, ui_router


def create_app(ctx: HttpContext, policy: BrowserPolicy, ui: UiOptions | None = None) -> ASGIApp:
    """The routes, behind the browser policy: the Host check outermost, so it also covers CORS preflights.

    `ui`: the web page and its engine-view stream (None: `--no-ui`, not served)."""
    app = FastAPI(title="kvserve", version=kvserve_version(), docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(openai_router(ctx))
    app.include_router(lora_router(ctx))
    app.include_router(service_router(ctx))
    if ui is not None:
        app.include_router(ui_router(ctx, ui, ViewHub(ctx.model_source, ui.interval_s, ctx.metrics)))
    install_error_handlers(app)
    return HostGuard(cors_middleware(app, policy.cors_origins), policy)
