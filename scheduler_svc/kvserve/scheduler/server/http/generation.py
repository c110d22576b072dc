"""An OpenAI request's prompts on the engine: validate each with the shared parser, submit, read back.

Each prompt is one engine request, validated by `parse_generate` and submitted exactly
as the gRPC servicer does (tenant-scoped id, the prefix namespace of the tenant and the
LoRA adapter), so both APIs share the queue limits, the prefix cache and the tenants. A
`Submission` owns those requests until their streams close: `abort_unfinished` (called in
every handler's `finally`) aborts whatever a failure or a client disconnect left running,
so their blocks return at the next step boundary.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvserve.protos.kvserve.v1 import api_pb2
from kvserve.protos.sampling import InvalidFieldError
from kvserve.protos.stop_rules import FinishReason
from kvserve.scheduler.core import RequestRejected
from kvserve.scheduler.server.delivery.request_stream import CompletionChunk, FailureKind, RequestFailed, RequestStream
from kvserve.scheduler.server.http.errors import bad_field, from_failure, model_not_found
from kvserve.scheduler.server.http.field_names import capacity_param, openai_param
from kvserve.scheduler.server.http.openai_request import OpenAiRequest
from kvserve.scheduler.server.http.responses import ChoiceState
from kvserve.scheduler.server.intake.request_parsing import ValidatedRequest, parse_generate
from kvserve.scheduler.server.intake.served_models import ModelNotFound
from kvserve.scheduler.server.security.namespaces import prefix_namespace, scoped_request_id
from kvserve.scheduler.server.serving_model import ServingModel

INLINE_TOKENIZE_CHARS = 20_000
"""Longer prompts are validated (tokenized) on a worker thread, as in the gRPC API, so streams keep flowing."""


@dataclass(slots=True)
class Submission:
    """The engine requests of one HTTP request, in prompt order."""

    model: ServingModel
    scoped_ids: list[str] = field(default_factory=list)
    streams: list[RequestStream] = field(default_factory=list)

    def abort_unfinished(self) -> None:
        for scoped, stream in zip(self.scoped_ids, self.streams):
            if not stream.closed:
                self.model.engine.abort(scoped)

    async def chunks(self) -> AsyncIterator[tuple[int, CompletionChunk]]:
        """(prompt index, chunk) in arrival order; raises RequestFailed for a failure or an abnormal end."""
        if len(self.streams) == 1:
            async for only in self.streams[0]:
                yield 0, _checked(only)
            return
        queue: asyncio.Queue[tuple[int, CompletionChunk | None, RequestFailed | None]] = asyncio.Queue()

        async def pump(prompt: int, stream: RequestStream) -> None:
            try:
                async for chunk in stream:
                    queue.put_nowait((prompt, chunk, None))
            except RequestFailed as exc:
                queue.put_nowait((prompt, None, exc))
                return
            queue.put_nowait((prompt, None, None))

        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                prompt, chunk, error = await queue.get()
                if error is not None:
                    raise error
                if chunk is None:
                    remaining -= 1
                    continue
                yield prompt, _checked(chunk)
        finally:
            for task in tasks:
                task.cancel()


def _checked(chunk: CompletionChunk) -> CompletionChunk:
    """An abort (drain past its grace) or an error end (no longer fits a new executor) is no OpenAI finish."""
    if chunk.finish_reason is FinishReason.ABORT:
        raise RequestFailed(FailureKind.UNAVAILABLE, "the request was aborted: the server is shutting down")
    if chunk.finish_reason is FinishReason.ERROR:
        raise RequestFailed(FailureKind.UNAVAILABLE, "the request could not be completed after an executor change")
    return chunk


async def _validate(request_pb: api_pb2.GenerateRequest, model: ServingModel) -> ValidatedRequest:
    kind = request_pb.WhichOneof("prompt")
    chars = len(request_pb.text) if kind == "text" else 0
    if kind == "chat":
        chars = sum(len(m.content) for m in request_pb.chat.messages)
    if chars > INLINE_TOKENIZE_CHARS:
        return await asyncio.to_thread(parse_generate, request_pb, model.tokenizer, model.limits)
    return parse_generate(request_pb, model.tokenizer, model.limits)


async def submit(model: ServingModel, parsed: OpenAiRequest, tenant: str, base_id: str) -> Submission:
    """Validate every prompt first (a bad one refuses the whole request), then submit them all.

    Raises ApiError: 400 naming the OpenAI field, 404 `model_not_found` for a `model` that is neither the
    served model nor one of its LoRA adapters, 429 queue full, 503 no executor or draining.
    """
    validated = []
    for i, prompt in enumerate(parsed.prompts):
        request_pb = prompt.request
        request_pb.request_id = base_id if len(parsed.prompts) == 1 else f"{base_id}-{i}"
        try:
            request = await _validate(request_pb, model)
            constraint = await model.grammars.constraint(request.structured)
        except ModelNotFound as exc:
            raise model_not_found(exc) from None
        except InvalidFieldError as exc:
            raise bad_field(openai_param(exc.field, prompt.names), exc.reason) from None
        validated.append((request, constraint, prompt.names))
    submission = Submission(model)
    try:
        for request, constraint, names in validated:
            namespace = prefix_namespace(
                model.info.model_id, tenant, request.cache_salt, request.lora_name, request.lora_id
            )
            scoped = dataclasses.replace(request, request_id=scoped_request_id(tenant, request.request_id))
            try:
                stream = model.engine.submit(scoped, namespace, constraint)
            except RequestRejected as exc:
                raise bad_field(capacity_param(exc.field, names), exc.reason) from None
            except ModelNotFound as exc:  # its adapter was unloaded since it was parsed
                raise model_not_found(exc) from None
            except InvalidFieldError as exc:
                raise bad_field(openai_param(exc.field, names), exc.reason) from None
            except RequestFailed as exc:
                raise from_failure(exc) from None
            submission.scoped_ids.append(scoped.request_id)
            submission.streams.append(stream)
    except BaseException:
        submission.abort_unfinished()
        raise
    return submission


async def collect_choices(submission: Submission, n: int, prefixes: list[str] | None = None) -> list[ChoiceState]:
    """Every choice in full (non-streaming responses), ordered by index; `prefixes[p]` is prompt p's echo."""
    choices = [
        ChoiceState(index=p * n + i, text=[prefixes[p]] if prefixes else [])
        for p in range(len(submission.streams))
        for i in range(n)
    ]
    async for prompt, chunk in submission.chunks():
        choice = choices[prompt * n + chunk.index]
        choice.text.append(chunk.text)
        choice.logprobs.extend(chunk.logprobs)
        choice.tool_calls.extend(chunk.tool_calls)
        if chunk.finish_reason is not None:
            choice.finish(chunk.finish_reason, chunk.usage)
    return choices
