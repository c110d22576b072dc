"""The web page at `/` and its read-only engine-view stream (`/ui/events`).

The page (`ui/index.html`, `ui/app.js`, `ui/style.css`, shipped in the package) is a chat
playground over `/v1/chat/completions` beside a live view of the block pool, the prefix tree
and the steps. The files are read once at start and served with a strict Content-Security-
Policy: scripts and styles from this origin only, no framing, no foreign connections. They
hold no secret, so they are open like `/health`; the page asks for the bearer token and sends
it on each call, and the event stream needs it like every API route. `--no-ui` removes all
four routes (404).
"""

from __future__ import annotations

import importlib.resources
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from kvserve.scheduler.server.engine_view.hub import TooManyViewers, ViewHub
from kvserve.scheduler.server.engine_view.snapshot import Viewer
from kvserve.scheduler.server.http.context import HttpContext
from kvserve.scheduler.server.http.errors import ApiError
from kvserve.scheduler.server.http.responses import SSE_HEADERS

ASSETS = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript", "style.css": "text/css"}
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
"""The page may load and call only its own origin, and no other site may frame it."""


@dataclass(frozen=True, slots=True)
class UiOptions:
    interval_s: float
    admin_tenants: frozenset[str]
    """Tenants whose viewers see every tenant's requests and text."""


def ui_router(ctx: HttpContext, options: UiOptions, hub: ViewHub) -> APIRouter:
    router = APIRouter()
    files = importlib.resources.files("kvserve.scheduler.server.http") / "ui"
    assets = {name: (files / name).read_bytes() for name in ASSETS}

    def asset(name: str) -> Response:
        return Response(assets[name], media_type=ASSETS[name], headers=PAGE_HEADERS)

    @router.get("/", include_in_schema=False)
    async def page() -> Response:
        return asset("index.html")

    @router.get("/ui/config")
    async def config() -> dict[str, object]:
        return {"auth": ctx.tokens is not None, "stream_interval_s": options.interval_s}

    @router.get("/ui/events")
    async def events(request: Request) -> Response:
        tenant = ctx.authenticate(request)
        ctx.require_model()  # 503 until an executor registered: there is no engine to show yet
        viewer = Viewer(tenant, admin=ctx.tokens is not None and tenant in options.admin_tenants)
        updates = hub.stream(viewer)
        try:
            first = await anext(updates)  # refuse a full hub with a status, not a broken stream
        except TooManyViewers as exc:
            raise ApiError(429, str(exc), type="rate_limit_error", code="too_many_viewers") from None
        return StreamingResponse(_events(first, updates), media_type="text/event-stream", headers=SSE_HEADERS)

    @router.get("/ui/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in ASSETS or name == "index.html":
            raise ApiError(404, f"no such page asset: {name[:64]!r}", code="not_found")
        return asset(name)

    return router


async def _events(first: bytes, updates: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    """`event: view` frames; leaving (the client went away) closes the subscription."""
    try:
        yield b"event: view\ndata: " + first + b"\n\n"
        async for update in updates:
            yield b"event: view\ndata: " + update + b"\n\n"
    finally:
        await updates.aclose()
