"""vLLM's runtime LoRA routes: `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.

The body is vLLM's: `{"lora_name": ..., "lora_path": ...}` to load, `{"lora_name": ...}` to unload.
Off unless the server runs with `--allow-runtime-lora` (404 naming the flag, as vLLM's routes are
absent without it); with tokens on, admin tenants only (403). The reply is JSON: what was done and
the adapters served after it. The rules themselves (what is refused, and why an adapter in use is
not unloaded) are `adapter_catalog.AdapterCatalog`'s.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request

from kvserve.protos.sampling import InvalidFieldError
from kvserve.scheduler.server.adapter_catalog import AdapterInUse, AdapterNotLoaded, RuntimeLoraOff
from kvserve.scheduler.server.executor_link.link_errors import ExecutorLost
from kvserve.scheduler.server.http.context import HttpContext
from kvserve.scheduler.server.http.errors import ApiError, bad_field
from kvserve.scheduler.server.http.request_body import read_json_object


def lora_router(ctx: HttpContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> dict[str, Any]:
        body = await _admin_body(ctx, request)
        name, path = _text(body, "lora_name"), _text(body, "lora_path")
        names = await _change(lambda: ctx.require_model().adapters.load(name, path))
        return {"object": "lora_adapters", "message": f"LoRA adapter {name!r} loaded", "lora_names": names}

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> dict[str, Any]:
        body = await _admin_body(ctx, request)
        name = _text(body, "lora_name")
        names = await _change(lambda: ctx.require_model().adapters.unload(name))
        return {"object": "lora_adapters", "message": f"LoRA adapter {name!r} unloaded", "lora_names": names}

    return router


async def _admin_body(ctx: HttpContext, request: Request) -> dict[str, Any]:
    ctx.require_admin(request)
    return await read_json_object(request, ctx.max_request_bytes)


def _text(body: dict[str, Any], name: str) -> str:
    value = body.get(name, "")
    if not isinstance(value, str):
        raise bad_field(name, f"must be a string, got {type(value).__name__}")
    return value


async def _change(change: Callable[[], Awaitable[list[str]]]) -> list[str]:
    """Run a load or unload, its refusals as OpenAI-shaped errors."""
    try:
        return await change()
    except RuntimeLoraOff as exc:
        raise ApiError(404, str(exc), code="runtime_lora_disabled") from None
    except AdapterNotLoaded as exc:
        raise ApiError(404, str(exc), param=exc.field, code="lora_adapter_not_found") from None
    except InvalidFieldError as exc:
        raise bad_field(exc.field, exc.reason) from None
    except AdapterInUse as exc:
        raise ApiError(409, str(exc), param="lora_name", code="lora_adapter_in_use") from None
    except ExecutorLost as exc:
        raise ApiError(
            503, f"the executor is not there to change: {exc}", type="service_unavailable", code="service_unavailable"
        ) from None
