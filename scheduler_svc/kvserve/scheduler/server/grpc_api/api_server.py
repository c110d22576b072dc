"""The gRPC front door: `KVServe`, standard health checking and server reflection (v1 and v1alpha).

The server starts before any executor has registered (health NOT_SERVING, Generate
UNAVAILABLE) so that orchestrators can watch it come up; `attach` hands it the engine
once the executor's handshake has sized the scheduler.

Status codes: INVALID_ARGUMENT "field: message" for bad fields (refused while parsing,
a duplicate in-flight id, or a request the KV cache can never hold), NOT_FOUND "model: ..." for
a `model` that is neither the served model nor one of its LoRA adapters, RESOURCE_EXHAUSTED
when the queue is full, UNAVAILABLE without a usable executor or while draining,
INTERNAL when the executor failed a step or sampled a token the grammar forbids. A body that is not valid protobuf gets
INVALID_ARGUMENT "request: not a valid <type> message: ..." (strict_handlers.py): every
service is registered with handlers that decode their own requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc
import structlog
from grpc_health.v1 import health, health_pb2

from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.protos.message_fields import copy_fields
from kvserve.protos.sampling import InvalidFieldError
from kvserve.protos.stop_rules import FinishReason
from kvserve.scheduler.core import DiskTierStats, RequestRejected
from kvserve.scheduler.server.adapter_catalog import AdapterInUse, AdapterNotLoaded, RuntimeLoraOff
from kvserve.scheduler.server.delivery.request_stream import CompletionChunk, FailureKind, RequestFailed
from kvserve.scheduler.server.engine_status import ExecutorState
from kvserve.scheduler.server.executor_link.link_errors import ExecutorLost
from kvserve.scheduler.server.grpc_api.reflection import enable_reflection
from kvserve.scheduler.server.grpc_api.strict_handlers import add_strict_service
from kvserve.scheduler.server.intake.request_parsing import encode_chat, encode_text, parse_generate
from kvserve.scheduler.server.intake.served_models import ModelNotFound
from kvserve.scheduler.server.security.auth import TokenTable
from kvserve.scheduler.server.security.namespaces import (
    ANONYMOUS_TENANT,
    prefix_namespace,
    scoped_request_id,
    tenant_from_metadata,
)
from kvserve.scheduler.server.server_config import ServerConfig
from kvserve.scheduler.server.serving_model import ServingModel
from kvserve.scheduler.server.tools.tool_use import ENDS_AFTER_CALLS, parse_tool_use

log = structlog.get_logger(__name__)

_KVSERVE = api_pb2.DESCRIPTOR.services_by_name["KVServe"]
_HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
SERVICE_NAME = _KVSERVE.full_name
TRANSPORT_SIZE_FACTOR = 4
"""gRPC accepts messages up to this multiple of --max-request-bytes, so a request somewhat over
the limit reaches validation and gets INVALID_ARGUMENT naming its prompt field; beyond it the
transport itself answers RESOURCE_EXHAUSTED without buffering the whole message."""

_FAILURE_CODES = {
    FailureKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    FailureKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailureKind.INTERNAL: grpc.StatusCode.INTERNAL,
}
_FINISH_REASONS = {
    FinishReason.STOP: api_pb2.FINISH_REASON_STOP,
    FinishReason.EOS: api_pb2.FINISH_REASON_EOS,
    FinishReason.GRAMMAR: api_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: api_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: api_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: api_pb2.FINISH_REASON_ERROR,
}
_EXECUTOR_STATES = {
    ExecutorState.WAITING: api_pb2.EXECUTOR_STATE_WAITING,
    ExecutorState.READY: api_pb2.EXECUTOR_STATE_READY,
    ExecutorState.LOST: api_pb2.EXECUTOR_STATE_LOST,
}


class KVServeServicer(api_pb2_grpc.KVServeServicer):
    """`tokens` (when auth is on) names each caller's tenant; without it everyone is anonymous."""

    def __init__(
        self,
        *,
        restarts: Callable[[], int] = lambda: 0,
        tokens: TokenTable | None = None,
        admins: frozenset[str] = frozenset(),
    ) -> None:
        self.model: ServingModel | None = None
        self._restarts = restarts
        self._tokens = tokens
        self._admins = admins

    def _tenant_of(self, context: grpc.aio.ServicerContext) -> str:
        metadata = context.invocation_metadata()
        if self._tokens is None:
            return tenant_from_metadata(metadata)
        # The auth interceptor already refused calls without a valid token.
        return self._tokens.tenant_from_metadata(metadata) or ANONYMOUS_TENANT

    def _require_model(self) -> ServingModel:
        if self.model is None:
            raise RequestFailed(FailureKind.UNAVAILABLE, "no executor has registered yet")
        return self.model

    async def Generate(
        self, request: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        try:
            model = self._require_model()
            if _prompt_chars(request) > _INLINE_TOKENIZE_CHARS:
                validated = await asyncio.to_thread(parse_generate, request, model.tokenizer, model.limits)
            else:
                validated = parse_generate(request, model.tokenizer, model.limits)
            tenant = self._tenant_of(context)
            namespace = prefix_namespace(
                model.info.model_id, tenant, validated.cache_salt, validated.lora_name, validated.lora_id
            )
            request_id = validated.request_id
            scoped = dataclasses.replace(validated, request_id=scoped_request_id(tenant, request_id))
            constraint = await model.grammars.constraint(validated.structured)
            stream = model.engine.submit(scoped, namespace, constraint)
        except ModelNotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except InvalidFieldError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RequestRejected as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(_capacity_error(exc)))
        except RequestFailed as exc:
            await context.abort(_FAILURE_CODES[exc.kind], exc.message)
        called: set[int] = set()  # completions that made tool calls: they finish TOOL_CALLS
        try:
            async for chunk in stream:
                if chunk.tool_calls:
                    called.add(chunk.index)
                yield _chunk_to_proto(request_id, chunk, chunk.index in called)
        except RequestFailed as exc:
            await context.abort(_FAILURE_CODES[exc.kind], exc.message)
        finally:
            # Cancel, deadline or disconnect: the generator is closed before the stream ended.
            if not stream.closed:
                model.engine.abort(scoped.request_id)

    async def Abort(self, request: api_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> api_pb2.AbortResponse:
        if self.model is None:
            return api_pb2.AbortResponse(found=False)
        scoped = scoped_request_id(self._tenant_of(context), request.request_id)
        return api_pb2.AbortResponse(found=self.model.engine.abort(scoped))

    async def Tokenize(
        self, request: api_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.TokenizeResponse:
        try:
            model = self._require_model()
            kind = request.WhichOneof("input")
            if kind == "text":
                ids = encode_text(request.text, model.tokenizer, "text")
            elif kind == "chat":
                tools = parse_tool_use(request.chat, "chat", model.limits.tool_call_format)
                ids = encode_chat(request.chat, model.tokenizer, "chat", tools)
            else:
                raise InvalidFieldError("input", "set text or chat")
        except InvalidFieldError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RequestFailed as exc:
            await context.abort(_FAILURE_CODES[exc.kind], exc.message)
        return api_pb2.TokenizeResponse(token_ids=ids, tokens=model.tokenizer.tokens(ids))

    async def ModelInfo(
        self, request: api_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.ModelInfoResponse:
        model = self.model
        if model is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no executor has registered yet")
            raise AssertionError("context.abort returned")  # pragma: no cover
        response = copy_fields(model.info, api_pb2.ModelInfoResponse)
        # The limits the server enforces, which may be tighter than the executor's.
        response.vocab_size = model.limits.vocab_size
        response.max_model_len = model.limits.max_model_len
        response.has_chat_template = model.tokenizer.has_chat_template
        del response.lora_names[:]
        response.lora_names.extend(model.limits.models.lora_names)  # with those loaded at run time
        return response

    async def LoadLoraAdapter(
        self, request: api_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.LoraAdaptersResponse:
        names = await self._change_adapters(context, lambda m: m.adapters.load(request.lora_name, request.lora_path))
        return api_pb2.LoraAdaptersResponse(lora_names=names)

    async def UnloadLoraAdapter(
        self, request: api_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.LoraAdaptersResponse:
        names = await self._change_adapters(context, lambda m: m.adapters.unload(request.lora_name))
        return api_pb2.LoraAdaptersResponse(lora_names=names)

    async def _change_adapters(
        self, context: grpc.aio.ServicerContext, change: Callable[[ServingModel], Awaitable[list[str]]]
    ) -> list[str]:
        """A runtime LoRA load or unload by an admin (anyone without tokens), its refusals as status codes."""
        tenant = self._tenant_of(context)
        if self._tokens is not None and tenant not in self._admins:
            log.warning("admin_call_refused", tenant=tenant)
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"tenant {tenant!r} may not change LoRA adapters: admin tenants only"
            )
        try:
            return await change(self._require_model())
        except RuntimeLoraOff as exc:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(exc))
        except AdapterNotLoaded as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except InvalidFieldError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except AdapterInUse as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ExecutorLost as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the executor is not there to change: {exc}")
        except RequestFailed as exc:
            await context.abort(_FAILURE_CODES[exc.kind], exc.message)
        raise AssertionError("context.abort returned")  # pragma: no cover

    async def ServerStats(
        self, request: api_pb2.ServerStatsRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.ServerStatsResponse:
        if self.model is None:
            return api_pb2.ServerStatsResponse(
                executor_state=api_pb2.EXECUTOR_STATE_WAITING, executor_restarts=self._restarts()
            )
        stats = self.model.engine.stats()
        s = stats.scheduler
        disk = s.disk or DiskTierStats()
        return api_pb2.ServerStatsResponse(
            kv_disk_blocks=disk.blocks_on_disk,
            kv_disk_loaded_blocks=disk.loaded_blocks,
            kv_disk_stored_blocks=disk.stored_blocks,
            kv_disk_failed_loads=disk.failed_loads,
            kv_host_loaded_blocks=disk.host_loaded_blocks,
            num_blocks=s.num_blocks,
            blocks_free=s.blocks_free,
            blocks_cached=s.blocks_cached,
            blocks_referenced=s.blocks_referenced,
            kv_usage=s.kv_usage,
            requests_waiting=s.num_waiting,
            requests_running=s.num_running,
            requests_swapped=s.num_swapped,
            prefix_queried_tokens=s.prefix_queried_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            num_preemptions=s.num_preemptions,
            num_swap_outs=s.num_swap_outs,
            num_evicted_blocks=s.num_evicted_blocks,
            draft_tokens_proposed=s.draft_tokens_proposed,
            draft_tokens_accepted=s.draft_tokens_accepted,
            draft_verify_steps=s.draft_verify_steps,
            executor_state=_EXECUTOR_STATES[stats.executor_state],
            executor_restarts=self._restarts(),
            steps=stats.steps,
        )


_INLINE_TOKENIZE_CHARS = 20_000
"""Longer prompts are tokenized on a worker thread so the event loop keeps streaming meanwhile."""


def _prompt_chars(request: api_pb2.GenerateRequest) -> int:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return len(request.text)
    if kind == "chat":
        return sum(len(m.content) for m in request.chat.messages)
    return 0


_CAPACITY_FIELDS = {"max_tokens": "sampling.max_tokens"}


def _capacity_error(exc: RequestRejected) -> InvalidFieldError:
    """The scheduler's capacity refusal as the API field error: the one core-to-API field mapping.

    Only the scheduler knows whether a request can ever fit (its max_model_len, its KV pool,
    which a new executor may shrink), so it refuses those itself and names its own parameter
    ("prompt" or "max_tokens"); only the API knows the field paths clients see.
    """
    return InvalidFieldError(_CAPACITY_FIELDS.get(exc.field, exc.field), exc.reason)


def _chunk_to_proto(request_id: str, chunk: CompletionChunk, called: bool = False) -> api_pb2.GenerateResponse:
    response = api_pb2.GenerateResponse(
        request_id=request_id, index=chunk.index, token_ids=chunk.token_ids, text=chunk.text
    )
    for call in chunk.tool_calls:
        response.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
    for lp in chunk.logprobs:
        response.logprobs.append(
            api_pb2.TokenLogprobs(
                token_id=lp.token_id,
                logprob=lp.logprob,
                top=[api_pb2.Logprob(token_id=t.token_id, logprob=t.logprob) for t in lp.top],
            )
        )
    if chunk.finish_reason is not None:
        response.finish_reason = _FINISH_REASONS[chunk.finish_reason]
        if called and chunk.finish_reason in ENDS_AFTER_CALLS:
            response.finish_reason = api_pb2.FINISH_REASON_TOOL_CALLS
    if chunk.usage is not None:
        u = chunk.usage
        response.usage.CopyFrom(
            api_pb2.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                cached_tokens=u.cached_tokens,
                host_cached_tokens=u.host_cached_tokens,
                disk_cached_tokens=u.disk_cached_tokens,
                queue_time_s=u.queue_time_s,
                ttft_s=u.ttft_s,
                e2e_s=u.e2e_s,
            )
        )
        if u.drafts is not None:
            response.usage.speculative.CopyFrom(
                api_pb2.SpeculativeUsage(
                    proposed_tokens=u.drafts.proposed,
                    accepted_tokens=u.drafts.accepted,
                    verify_steps=u.drafts.verify_steps,
                )
            )
    return response


class ApiServer:
    """The grpc.aio server with KVServe, health and reflection; `serving` drives the health status."""

    def __init__(
        self,
        config: ServerConfig,
        servicer: KVServeServicer,
        *,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        self._config = config
        self.servicer = servicer
        self._credentials = credentials
        options = [
            ("grpc.max_receive_message_length", TRANSPORT_SIZE_FACTOR * config.max_request_bytes),
            ("grpc.so_reuseport", 0),
        ]
        self._server = grpc.aio.server(interceptors=list(interceptors), options=options)
        # Not api_pb2_grpc.add_KVServeServicer_to_server: its deserializers raise inside grpc
        # (UNKNOWN and a traceback) on a body that is not valid protobuf.
        add_strict_service(self._server, servicer, _KVSERVE)
        self.health = health.aio.HealthServicer()
        add_strict_service(self._server, self.health, _HEALTH)
        enable_reflection(self._server, (SERVICE_NAME, health.SERVICE_NAME))
        self.port: int | None = None
        self._state_tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        await self.set_serving(False)
        address = f"{self._config.host}:{self._config.port}"
        if self._credentials is not None:
            self.port = self._server.add_secure_port(address, self._credentials)
        else:
            self.port = self._server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"cannot listen on {address}")
        await self._server.start()
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    def on_executor_state(self, state: ExecutorState) -> None:
        """Engine callback (sync): SERVING only while an executor is ready."""
        task = asyncio.get_running_loop().create_task(self.set_serving(state is ExecutorState.READY))
        self._state_tasks.add(task)
        task.add_done_callback(self._state_tasks.discard)

    async def enter_drain(self) -> None:
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace_s: float | None = 1.0) -> None:
        await self._server.stop(grace_s)
