"""`POST /v1/chat/completions`, `POST /v1/completions` and `GET /v1/models`.

Each generation request: authenticate (tenant), read the body with its size limit,
parse the OpenAI shape, then validate (`model` first: the base model or a LoRA adapter) and
submit every prompt through the shared path (`generation.submit`), and answer in full or as
server-sent events. A client that disconnects, streaming or not, aborts its requests
within one step.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvserve.scheduler.server.delivery.request_stream import RequestFailed
from kvserve.scheduler.server.http.context import HttpContext
from kvserve.scheduler.server.http.errors import from_failure
from kvserve.scheduler.server.http.generation import Submission, collect_choices, submit
from kvserve.scheduler.server.http.openai_request import OpenAiRequest, parse_chat_body, parse_completion_body
from kvserve.scheduler.server.http.request_body import read_json_object
from kvserve.scheduler.server.http.responses import (
    SSE_HEADERS,
    Envelope,
    LogprobFormatter,
    chat_completion,
    completion,
)
from kvserve.scheduler.server.http.sse import StreamShape, chat_events, completion_events
from kvserve.scheduler.server.security.namespaces import scoped_request_id
from kvserve.scheduler.server.serving_model import ServingModel

log = structlog.get_logger(__name__)

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its non-streaming response was ready."""


def openai_router(ctx: HttpContext) -> APIRouter:
    router = APIRouter()
    started = int(time.time())

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(ctx, request, chat=True)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(ctx, request, chat=False)

    @router.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        """The base model under each of its names, then each LoRA adapter, whose `parent` is the base model
        (vLLM's cards: `root` is what the model was loaded from, as far as the scheduler knows it)."""
        ctx.authenticate(request)
        served = ctx.require_model().limits.models
        card = {"object": "model", "created": started, "owned_by": "kvserve"}
        base = [{"id": name, **card, "root": served.base_id, "parent": None} for name in served.base_names]
        adapters = [{"id": name, **card, "root": name, "parent": served.base_id} for name in served.lora_names]
        return {"object": "list", "data": base + adapters}

    return router


async def _generate(ctx: HttpContext, request: Request, *, chat: bool) -> Response:
    tenant = ctx.authenticate(request)
    data = await read_json_object(request, ctx.max_request_bytes)
    parsed = parse_chat_body(data) if chat else parse_completion_body(data)
    model = ctx.require_model()
    model_name = parsed.model or model.limits.models.base_id  # checked with the prompts, by parse_generate
    endpoint = request.url.path
    if parsed.unknown:
        log.warning("http_unknown_fields_ignored", endpoint=endpoint, fields=list(parsed.unknown))
    base_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    log.info(
        "http_request",
        endpoint=endpoint,
        request_id=scoped_request_id(tenant, base_id),
        prompts=len(parsed.prompts),
        stream=parsed.stream,
        user=parsed.user,
    )
    submission = await submit(model, parsed, tenant, base_id)
    try:
        env = Envelope(id=base_id, created=int(time.time()), model=model_name)
        formatter = LogprobFormatter(model.tokenizer) if parsed.logprobs else None
        prefixes = _echo_prefixes(parsed, model) if parsed.echo else None
        if parsed.stream:
            shape = StreamShape(env, parsed.n, parsed.include_usage, formatter, prefixes)
            events = chat_events(submission, shape) if chat else completion_events(submission, shape)
            # The generator aborts on its way out; the background task covers a client gone before it started.
            return StreamingResponse(
                events,
                media_type="text/event-stream",
                headers=SSE_HEADERS,
                background=BackgroundTask(submission.abort_unfinished),
            )
        return await _respond_in_full(request, submission, parsed, env, formatter, prefixes)
    except BaseException:
        submission.abort_unfinished()
        raise


async def _respond_in_full(
    request: Request,
    submission: Submission,
    parsed: OpenAiRequest,
    env: Envelope,
    formatter: LogprobFormatter | None,
    prefixes: list[str] | None,
) -> Response:
    try:
        choices = await _unless_disconnected(request, collect_choices(submission, parsed.n, prefixes))
    except RequestFailed as exc:
        raise from_failure(exc) from None
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the requests were aborted below
    finally:
        submission.abort_unfinished()
    build = chat_completion if parsed.chat else completion
    return JSONResponse(build(env, choices, parsed.n, formatter))


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone as soon as the client hangs up (the body is read by now)."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    watcher = loop.create_task(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone
    finally:
        task.cancel()
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _echo_prefixes(parsed: OpenAiRequest, model: ServingModel) -> list[str]:
    """`echo`: each prompt's text, decoded from its token ids when it was given as ids."""
    prefixes = []
    for prompt in parsed.prompts:
        request = prompt.request
        if request.WhichOneof("prompt") == "text":
            prefixes.append(request.text)
        else:
            prefixes.append(model.tokenizer.decode(list(request.token_ids.ids)))
    return prefixes
