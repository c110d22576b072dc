"""The routes around generation: health, readiness, load, tokenize/detokenize, version, Prometheus metrics.

`/health` (liveness: 200 while the process runs), `/ready` and `/get_load` are open, like gRPC
health checking: orchestrators probe them without secrets. Everything else needs the
bearer token when auth is on. `/tokenize` uses the same encoders as generation, so its
count is the `prompt_tokens` a request with the same prompt reports.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvserve.protos.kvserve.v1 import api_pb2
from kvserve.protos.sampling import InvalidFieldError
from kvserve.scheduler.server.http.context import HttpContext
from kvserve.scheduler.server.http.errors import ApiError, bad_field
from kvserve.scheduler.server.http.field_names import ParamNames, openai_param
from kvserve.scheduler.server.http.json_fields import JsonObject, as_integer
from kvserve.scheduler.server.http.openai_request import parse_messages
from kvserve.scheduler.server.http.readiness import ReadinessCheck
from kvserve.scheduler.server.http.request_body import read_json_object
from kvserve.scheduler.server.intake.request_parsing import encode_chat, encode_text


def kvserve_version() -> str:
    try:
        return importlib.metadata.version("kvserve")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a bare checkout
        return "unknown"


def service_router(ctx: HttpContext) -> APIRouter:
    router = APIRouter()
    readiness = ReadinessCheck(ctx.model_source)

    @router.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/ready")
    async def ready() -> Response:
        reason = await readiness.check(draining=ctx.draining)
        if reason is None:
            return JSONResponse({"status": "ready"})
        error = ApiError(503, reason, type="service_unavailable", code="not_ready")
        return JSONResponse(error.body(), status_code=503)

    @router.get("/get_load")
    async def get_load() -> dict[str, int]:
        """Open like `/health`: routers poll it without a token (vllm-router's power_of_two reads `load`)."""
        model = ctx.model_source()
        if model is None:
            return {"load": 0}
        stats = model.engine.stats().scheduler
        return {"load": stats.num_running + stats.num_waiting}

    @router.get("/version")
    async def version(request: Request) -> dict[str, str]:
        ctx.authenticate(request)
        return {"version": kvserve_version()}

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        ctx.authenticate(request)
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's shape: `{"prompt": TEXT}` or `{"messages": [...]}` → count, ids and token strings.

        A token-id `prompt` (as /v1/completions takes) comes back as itself, checked against the
        vocabulary: vllm-router's kv_aware policy tokenizes every request this way, token prompts too."""
        ctx.authenticate(request)
        body = JsonObject(await read_json_object(request, ctx.max_request_bytes))
        model = ctx.require_model()
        ctx.resolve_model(body.string("model"), model)
        if isinstance(body.raw("prompt"), list):
            ids = _vocabulary_ids(body, "prompt", model.limits.vocab_size)
        else:
            text = body.string("prompt")
            try:
                if text is not None:
                    ids = encode_text(text, model.tokenizer, "text")
                elif body.present("messages"):
                    chat = api_pb2.ChatPrompt(messages=parse_messages(body, []))
                    ids = encode_chat(chat, model.tokenizer, "chat")
                else:
                    raise bad_field(None, "send `prompt` (a string or token ids) or `messages`")
            except InvalidFieldError as exc:
                names = ParamNames(prompt="prompt" if text is not None else "messages")
                raise bad_field(openai_param(exc.field, names), exc.reason) from None
        return {
            "count": len(ids),
            "max_model_len": model.limits.max_model_len,
            "tokens": ids,
            "token_strs": model.tokenizer.tokens(ids),
        }

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        ctx.authenticate(request)
        body = JsonObject(await read_json_object(request, ctx.max_request_bytes))
        model = ctx.require_model()
        ctx.resolve_model(body.string("model"), model)
        if body.array("tokens") is None:
            raise bad_field("tokens", "is required")
        ids = _vocabulary_ids(body, "tokens", model.limits.vocab_size)
        return {"prompt": model.tokenizer.decode(ids)}

    return router


def _vocabulary_ids(body: JsonObject, name: str, vocab: int) -> list[int]:
    """The token-id array `name`, each id checked to lie in [0, vocab) (400 naming the element)."""
    ids = [as_integer(t, f"{name}[{i}]") for i, t in enumerate(body.array(name) or [])]
    for i, token_id in enumerate(ids):
        if not 0 <= token_id < vocab:
            raise bad_field(f"{name}[{i}]", f"token id {token_id} is outside the vocabulary [0, {vocab})")
    return ids
