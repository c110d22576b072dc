"""Translate between the clients' Python types and the api.proto messages.

Kept apart from the transport so the sync and asyncio clients build requests and read
responses identically, and so the conversion can be tested without a server.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import grpc

from kvserve.clients.errors import KVServeError
from kvserve.clients.types import Chunk, Completion, SpeculativeUsage, TokenLogprobs, ToolCall, Usage
from kvserve.protos.kvserve.v1 import api_pb2

SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in api_pb2.SamplingParams.DESCRIPTOR.fields)
"""The accepted sampling keyword arguments: exactly api.proto's SamplingParams field names."""


def build_generate_request(
    prompt: str | None = None,
    *,
    token_ids: Iterable[int] | None = None,
    messages: Iterable[Mapping[str, Any]] | None = None,
    request_id: str | None = None,
    priority: int = 0,
    cache_salt: str = "",
    structured: Mapping[str, Any] | None = None,
    tools: Iterable[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, str] | None = None,
    parallel_tool_calls: bool | None = None,
    model: str = "",
    **sampling: Any,
) -> api_pb2.GenerateRequest:
    """Build a GenerateRequest from exactly one prompt form plus sampling keyword arguments.

    Sampling values of None are left unset, so the server default applies. `model` names a LoRA
    adapter the server loaded (its `model_info()["lora_names"]`); "" or the served model's id runs
    the base model, and any other name fails with NOT_FOUND. `structured`
    constrains the output (see `structured_output`), e.g. `{"json_schema": {...}}`. With
    `messages`, `tools` (see `add_tool`), `tool_choice` ("none", "auto", "required" or
    `{"function": NAME}`) and `parallel_tool_calls` let the model call functions.
    """
    request = api_pb2.GenerateRequest(
        request_id=request_id or "", priority=priority, cache_salt=cache_salt, model=model or ""
    )
    given = [
        name
        for name, value in (("prompt", prompt), ("token_ids", token_ids), ("messages", messages))
        if value is not None
    ]
    if len(given) != 1:
        raise ValueError(f"give exactly one of prompt, token_ids or messages (got {given or 'none'})")
    if prompt is not None:
        request.text = prompt
    elif token_ids is not None:
        request.token_ids.ids.extend(int(t) for t in token_ids)
    else:
        request.chat.CopyFrom(chat_prompt(messages or ()))
    if tools is not None or tool_choice is not None or parallel_tool_calls is not None:
        if messages is None:
            raise ValueError("tools, tool_choice and parallel_tool_calls need messages")
        for tool in tools or ():
            add_tool(request.chat, tool)
        if tool_choice is not None:
            request.chat.tool_choice.CopyFrom(tool_choice_message(tool_choice))
        if parallel_tool_calls is not None:
            request.chat.parallel_tool_calls = parallel_tool_calls
    fill_sampling(request.sampling, sampling)
    if structured is not None:
        request.structured.CopyFrom(structured_output(structured))
    return request


STRUCTURED_KINDS: tuple[str, ...] = tuple(f.name for f in api_pb2.StructuredOutput.DESCRIPTOR.fields)
"""json_schema, json_object, regex, choice, grammar: api.proto's StructuredOutput kinds."""


def structured_output(spec: Mapping[str, Any]) -> api_pb2.StructuredOutput:
    """One constraint as a dict: `{"json_schema": dict or JSON text}`, `{"json_object": True}`,
    `{"regex": str}`, `{"choice": [str, ...]}` or `{"grammar": str}` (Lark syntax)."""
    if len(spec) != 1 or next(iter(spec)) not in STRUCTURED_KINDS:
        raise ValueError(f"structured takes exactly one of {', '.join(STRUCTURED_KINDS)} (got {sorted(spec)})")
    ((kind, value),) = spec.items()
    if kind == "json_schema":
        return api_pb2.StructuredOutput(json_schema=value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        return api_pb2.StructuredOutput(choice=api_pb2.ChoiceList(choices=list(value)))
    return api_pb2.StructuredOutput(**{kind: value})


def chat_prompt(messages: Iterable[Mapping[str, Any]]) -> api_pb2.ChatPrompt:
    """Chat messages as dicts with `role` and `content` -> ChatPrompt. An assistant turn may carry
    `tool_calls` (ToolCall objects or dicts with id, name, arguments); a tool turn `tool_call_id`."""
    chat = api_pb2.ChatPrompt()
    for message in messages:
        pb = chat.messages.add(
            role=message["role"], content=message.get("content") or "", tool_call_id=message.get("tool_call_id", "")
        )
        for call in message.get("tool_calls") or ():
            fields = (
                call if isinstance(call, Mapping) else {"id": call.id, "name": call.name, "arguments": call.arguments}
            )
            arguments = fields.get("arguments", "")
            pb.tool_calls.add(
                id=fields.get("id", ""),
                name=fields["name"],
                arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
            )
    return chat


def add_tool(chat: api_pb2.ChatPrompt, tool: Mapping[str, Any]) -> None:
    """A function as `{"name", "description", "parameters": JSON Schema}`, or in OpenAI's
    `{"type": "function", "function": {...}}` wrapping."""
    function = tool.get("function", tool)
    parameters = function.get("parameters")
    chat.tools.add(
        name=function["name"],
        description=function.get("description", ""),
        parameters="" if parameters is None else parameters if isinstance(parameters, str) else json.dumps(parameters),
    )


def tool_choice_message(choice: str | Mapping[str, str]) -> api_pb2.ToolChoice:
    if isinstance(choice, Mapping):
        return api_pb2.ToolChoice(function=choice["function"])
    modes = {"none": api_pb2.TOOL_CHOICE_MODE_NONE, "auto": api_pb2.TOOL_CHOICE_MODE_AUTO}
    modes["required"] = api_pb2.TOOL_CHOICE_MODE_REQUIRED
    if choice not in modes:
        raise ValueError(f'tool_choice must be "none", "auto", "required" or {{"function": NAME}}, not {choice!r}')
    return api_pb2.ToolChoice(mode=modes[choice])


def fill_sampling(target: api_pb2.SamplingParams, sampling: Mapping[str, Any]) -> None:
    """Copy keyword arguments onto SamplingParams; an unknown name is a TypeError naming it."""
    for name, value in sampling.items():
        if name not in SAMPLING_FIELDS:
            raise TypeError(f"unknown sampling parameter {name!r}; expected one of {', '.join(SAMPLING_FIELDS)}")
        if value is None:
            continue
        current = getattr(target, name)
        if isinstance(current, (bool, int, float, str)):
            setattr(target, name, value)
        elif isinstance(current, MutableMapping):  # logit_bias: {token id: bias}
            target.ClearField(name)
            getattr(target, name).update(value)
        else:  # repeated field; a lone string would otherwise be split into characters
            target.ClearField(name)
            getattr(target, name).extend([value] if isinstance(value, (str, int)) else value)


def requested_n(sampling: Mapping[str, Any]) -> int:
    n = sampling.get("n")
    return 1 if n is None else int(n)


def finish_reason_name(value: int) -> str | None:
    """FinishReason enum -> "stop"/"eos"/"length"/"abort"/"error", or None while still running."""
    if value == api_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return enum_label(api_pb2.FinishReason.DESCRIPTOR, value).lower()


def usage_from_proto(usage: api_pb2.Usage) -> Usage:
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        queue_time_s=usage.queue_time_s,
        ttft_s=usage.ttft_s,
        e2e_s=usage.e2e_s,
        speculative=SpeculativeUsage(
            usage.speculative.proposed_tokens, usage.speculative.accepted_tokens, usage.speculative.verify_steps
        )
        if usage.HasField("speculative")
        else None,
    )


def chunk_from_response(response: api_pb2.GenerateResponse) -> Chunk:
    return Chunk(
        request_id=response.request_id,
        index=response.index,
        token_ids=list(response.token_ids),
        text=response.text,
        logprobs=[
            TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, top=[(alt.token_id, alt.logprob) for alt in lp.top])
            for lp in response.logprobs
        ],
        finish_reason=finish_reason_name(response.finish_reason),
        usage=usage_from_proto(response.usage) if response.HasField("usage") else None,
        tool_calls=[ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in response.tool_calls],
    )


class CompletionAssembler:
    """Collect streamed chunks, per index, into Completions (shared by both clients' `generate`)."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._request_id = ""
        self._parts: dict[int, _Partial] = {}

    def add(self, chunk: Chunk) -> None:
        self._request_id = self._request_id or chunk.request_id
        part = self._parts.setdefault(chunk.index, _Partial())
        part.text.append(chunk.text)
        part.token_ids.extend(chunk.token_ids)
        part.logprobs.extend(chunk.logprobs)
        part.tool_calls.extend(chunk.tool_calls)
        if chunk.finish_reason is not None:
            part.finish_reason = chunk.finish_reason
        if chunk.usage is not None:
            part.usage = chunk.usage

    def result(self) -> Completion:
        """The finished completion; raises KVServeError if the stream ended before an index finished."""
        choices = []
        for index in range(max(self._n, len(self._parts))):
            part = self._parts.get(index)
            if part is None or part.finish_reason is None:
                raise KVServeError(
                    grpc.StatusCode.UNKNOWN,
                    f"stream ended before completion {index} finished (request {self._request_id!r})",
                )
            choices.append(
                Completion(
                    request_id=self._request_id,
                    text="".join(part.text),
                    token_ids=part.token_ids,
                    finish_reason=part.finish_reason,
                    logprobs=part.logprobs,
                    index=index,
                    usage=part.usage or Usage(0, len(part.token_ids), 0, 0.0, 0.0, 0.0),
                    tool_calls=part.tool_calls,
                )
            )
        first = choices[0]
        return Completion(
            request_id=first.request_id,
            text=first.text,
            token_ids=list(first.token_ids),
            finish_reason=first.finish_reason,
            usage=first.usage,
            logprobs=list(first.logprobs),
            index=0,
            choices=choices,
            tool_calls=list(first.tool_calls),
        )


class _Partial:
    __slots__ = ("finish_reason", "logprobs", "text", "token_ids", "tool_calls", "usage")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.tool_calls: list[ToolCall] = []


def enum_label(enum_type: Any, number: int) -> str:
    """ExecutorState 2 -> "READY": the value name without the enum's UPPER_SNAKE prefix."""
    prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum_type.name).upper() + "_"
    return enum_type.values_by_number[number].name.removeprefix(prefix)


def message_to_dict(message: Any) -> dict[str, Any]:
    """A flat response message (ModelInfo, ServerStats) -> dict; enums become their names."""
    result: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.enum_type is not None and isinstance(value, int):
            result[field.name] = enum_label(field.enum_type, value)
        elif isinstance(value, (bool, int, float, str, bytes)):
            result[field.name] = value
        else:
            result[field.name] = list(value)
    return result
