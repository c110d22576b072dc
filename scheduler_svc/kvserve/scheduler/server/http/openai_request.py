"""OpenAI request bodies → `api_pb2.GenerateRequest`s, checking only what the OpenAI shape adds.

The value ranges, the prompt limits and the chat roles are checked afterwards by the
shared `parse_generate`, exactly as for gRPC (errors renamed by `field_names`). Here:
JSON types, the prompt and message shapes, `stream_options`, and the OpenAI fields
kvserve cannot honour, which are refused with a 400 naming them rather than ignored.
Unknown fields are ignored, collected in `unknown` for one warning.

A list of prompts (completions) becomes one `GenerateRequest` per prompt, each with its
n choices, numbered `prompt_index * n + i` as OpenAI does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from kvserve.config import defaults
from kvserve.protos.kvserve.v1 import api_pb2
from kvserve.scheduler.server.http.errors import bad_field, unsupported
from kvserve.scheduler.server.http.field_names import ParamNames
from kvserve.scheduler.server.http.json_fields import JsonObject, as_integer, as_list, as_object, as_string, json_type
from kvserve.scheduler.server.http.structured_body import structured_output
from kvserve.scheduler.server.http.tool_fields import message_content_optional, read_message_tools, read_tools

_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INTS = ("seed", "n", "min_tokens")
_LEGACY_FUNCTIONS = "the deprecated function-calling fields are not implemented; use tools and tool_choice"


@dataclass(frozen=True, slots=True)
class PromptRequest:
    """One prompt's engine request and the OpenAI names its errors use."""

    request: api_pb2.GenerateRequest
    names: ParamNames


@dataclass(frozen=True, slots=True)
class OpenAiRequest:
    """A parsed chat or completions body; `prompts` still needs `parse_generate`."""

    chat: bool
    model: str | None
    prompts: tuple[PromptRequest, ...]
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    echo: bool
    user: str | None
    unknown: tuple[str, ...]


def parse_chat_body(data: dict[str, Any]) -> OpenAiRequest:
    body = JsonObject(data)
    unknown: list[str] = []
    chat = api_pb2.ChatPrompt(messages=parse_messages(body, unknown))
    read_tools(body, chat, unknown)
    _refuse_chat_only(body)
    logprobs = bool(body.boolean("logprobs"))
    top_logprobs = body.integer("top_logprobs")
    if top_logprobs is not None and not logprobs:
        raise bad_field("top_logprobs", "needs logprobs: true")
    sampling, max_tokens_param = _sampling(body, chat=True)
    if logprobs:
        sampling.logprobs = top_logprobs or 0
    request = api_pb2.GenerateRequest(chat=chat, sampling=sampling)
    structured_param = _request_options(body, request)
    names = ParamNames(
        prompt="messages", max_tokens=max_tokens_param, logprobs="top_logprobs", structured=structured_param
    )
    return _finish(body, unknown, True, (PromptRequest(request, names),), logprobs=logprobs, echo=False)


def parse_completion_body(data: dict[str, Any]) -> OpenAiRequest:
    body = JsonObject(data)
    unknown: list[str] = []
    prompts = _prompts(body)
    _refuse_if(body, "suffix", lambda v: v != "", "insertion is not implemented")
    logprobs = body.integer("logprobs")
    echo = bool(body.boolean("echo"))
    if echo and logprobs is not None:
        raise unsupported("echo", "with logprobs it needs the prompt's logprobs, which are not computed")
    sampling, max_tokens_param = _sampling(body, chat=False)
    n = sampling.n if sampling.HasField("n") else 1
    _refuse_if(body, "best_of", lambda v: v != n, "best_of must equal n")
    if logprobs is not None:
        sampling.logprobs = logprobs
    built = []
    for i, prompt in enumerate(prompts):
        request = api_pb2.GenerateRequest(sampling=sampling)
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        structured_param = _request_options(body, request)
        names = ParamNames(
            prompt="prompt" if len(prompts) == 1 else f"prompt[{i}]",
            max_tokens=max_tokens_param,
            structured=structured_param,
        )
        built.append(PromptRequest(request, names))
    return _finish(body, unknown, False, tuple(built), logprobs=logprobs is not None, echo=echo)


def _finish(
    body: JsonObject,
    unknown: list[str],
    chat: bool,
    prompts: tuple[PromptRequest, ...],
    *,
    logprobs: bool,
    echo: bool,
) -> OpenAiRequest:
    """The fields both endpoints share: model, streaming, user; then what nobody read."""
    model = body.string("model")
    for prompt in prompts:  # the base model or a LoRA adapter, resolved by the shared parse_generate
        prompt.request.model = model or ""
    stream = bool(body.boolean("stream"))
    include_usage = False
    options = body.child("stream_options")
    if options is not None:
        if not stream:
            raise bad_field("stream_options", "only allowed when stream is true")
        include_usage = bool(options.boolean("include_usage"))
        unknown.extend(options.unread())
    user = body.string("user")
    sampling = prompts[0].request.sampling
    return OpenAiRequest(
        chat=chat,
        model=model,
        prompts=prompts,
        n=sampling.n if sampling.HasField("n") else 1,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        echo=echo,
        user=user,
        unknown=tuple(body.unread() + unknown),
    )


def _sampling(body: JsonObject, *, chat: bool) -> tuple[api_pb2.SamplingParams, str]:
    """The sampling fields both endpoints share (OpenAI's and vLLM's extras), and the length field's name."""
    pb = api_pb2.SamplingParams()
    for name in _FLOATS:
        value = body.number(name)
        if value is not None:
            setattr(pb, name, value)
    for name in _INTS:
        integer = body.integer(name)
        if integer is not None:
            setattr(pb, name, integer)
    top_k = body.integer("top_k")
    if top_k is not None:
        pb.top_k = -1 if top_k == 0 else top_k  # vLLM: 0 or -1 is off; the core spells off -1 only
    stop = body.raw("stop")
    if isinstance(stop, str):
        pb.stop.append(stop)
    elif stop is not None:
        pb.stop.extend(as_string(s, f"stop[{i}]") for i, s in enumerate(as_list(stop, "stop")))
    stop_ids = body.array("stop_token_ids")
    if stop_ids is not None:
        pb.stop_token_ids.extend(as_integer(t, f"stop_token_ids[{i}]") for i, t in enumerate(stop_ids))
    pb.ignore_eos = bool(body.boolean("ignore_eos"))
    _logit_bias(body, pb)
    max_tokens = body.integer("max_tokens")
    name = "max_tokens"
    if chat:
        newer = body.integer("max_completion_tokens")
        if newer is not None:
            if max_tokens is not None and max_tokens != newer:
                raise bad_field("max_tokens", "conflicts with max_completion_tokens; send one of them")
            max_tokens, name = newer, "max_completion_tokens"
    if max_tokens is not None:
        pb.max_tokens = max_tokens
    return pb, name


def _logit_bias(body: JsonObject, pb: api_pb2.SamplingParams) -> None:
    """OpenAI's `logit_bias`, `{"50256": -100}`: keys are token ids written as decimal strings. Here only
    the JSON shape (integer keys, number values, no id twice); the ranges and the entry count are
    `SamplingParams.validate`'s, after the engine knows the vocabulary."""
    raw = body.raw("logit_bias")
    if raw is None:
        return
    param = body.param("logit_bias")
    for key, value in as_object(raw, param).items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise bad_field(param, f"keys must be token ids (decimal integers), got {key[:32]!r}")
        token = int(key) if len(key) <= _INT64_DIGITS else None  # int() of a long string is slow, then refused
        if token is None or not _INT64[0] <= token <= _INT64[1]:
            raise bad_field(param, f"token id {key[:32]} is outside the vocabulary")
        if token in pb.logit_bias:
            raise bad_field(param, f"token id {token} is given twice")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_field(param, f"the bias of token {token} must be a number, got {json_type(value)}")
        try:
            pb.logit_bias[token] = float(value)
        except OverflowError:  # a JSON integer past float's range: an infinite bias, refused by the shared check
            pb.logit_bias[token] = math.inf if value > 0 else -math.inf


_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")
"""A `logit_bias` key: a decimal integer, ASCII digits only (no spaces, signs other than -, or underscores,
which Python's int() would take)."""
_INT64 = (-(2**63), 2**63 - 1)
_INT64_DIGITS = 20


def _request_options(body: JsonObject, request: api_pb2.GenerateRequest) -> str:
    """vLLM's request-level extras (scheduling priority, a prefix-cache salt) and the structured-output
    constraint; returns the OpenAI name of the constraint's field, for its errors."""
    priority = body.integer("priority")
    if priority is not None:
        request.priority = priority
    salt = body.string("cache_salt")
    if salt is not None:
        request.cache_salt = salt
    structured, param = structured_output(body)
    if structured is not None:
        request.structured.CopyFrom(structured)
    return param


def parse_messages(body: JsonObject, unknown: list[str]) -> list[api_pb2.ChatMessage]:
    raw = body.array("messages")
    if raw is None:
        raise bad_field("messages", "is required")
    out = []
    for i, item in enumerate(raw):
        message = JsonObject(as_object(item, f"messages[{i}]"), prefix=f"messages[{i}].")
        role = message.string("role")
        if role is None:
            raise bad_field(message.param("role"), "is required")
        if role == "developer":
            role = "system"  # OpenAI's newer name for system instructions
        raw_content = message.raw("content")
        optional = raw_content is None and message_content_optional(message)
        content = "" if optional else _content(raw_content, message.param("content"))
        _refuse_if(message, "function_call", lambda v: True, _LEGACY_FUNCTIONS)
        _refuse_if(message, "audio", lambda v: True, "audio is not supported")
        message.raw("name")  # participant names: accepted, not shown to the model (no template uses them)
        message.raw("refusal")
        pb = api_pb2.ChatMessage(role=role, content=content)
        read_message_tools(message, pb)
        unknown.extend(message.unread())
        out.append(pb)
    return out


def _content(value: Any, param: str) -> str:
    """A string, or text parts `[{"type": "text", "text": ...}]` joined with newlines."""
    if value is None:
        raise bad_field(param, "is required")
    if isinstance(value, str):
        return value
    parts = []
    for j, item in enumerate(as_list(value, param)):
        part = as_object(item, f"{param}[{j}]")
        kind = part.get("type")
        if kind != "text":
            shown = kind if isinstance(kind, str) else json_type(kind)
            raise unsupported(f"{param}[{j}].type", f"only text parts are, not {shown!r}")
        parts.append(as_string(part.get("text"), f"{param}[{j}].text"))
    return "\n".join(parts)


def _prompts(body: JsonObject) -> list[str | list[int]]:
    """OpenAI's four prompt shapes: a string, strings, token ids, arrays of token ids."""
    raw = body.raw("prompt")
    if raw is None:
        raise bad_field("prompt", "is required")
    if isinstance(raw, str):
        return [raw]
    items = as_list(raw, "prompt")
    if not items:
        raise bad_field("prompt", "must not be empty")
    prompts: list[str | list[int]]
    if all(isinstance(p, str) for p in items):
        prompts = list(items)
    elif all(isinstance(p, int | float) and not isinstance(p, bool) for p in items):
        prompts = [[as_integer(t, f"prompt[{i}]") for i, t in enumerate(items)]]
    elif all(isinstance(p, list) for p in items):
        prompts = [[as_integer(t, f"prompt[{i}][{j}]") for j, t in enumerate(p)] for i, p in enumerate(items)]
    else:
        raise bad_field(
            "prompt", "must be a string, an array of strings, an array of token ids or an array of token-id arrays"
        )
    if len(prompts) > defaults.MAX_HTTP_PROMPTS:
        raise bad_field("prompt", f"at most {defaults.MAX_HTTP_PROMPTS} prompts per request")
    return prompts


def _refuse_chat_only(body: JsonObject) -> None:
    """The chat fields whose behaviour kvserve does not implement: a 400 naming them, never a silent no-op."""
    _refuse_if(body, "functions", lambda v: v != [], _LEGACY_FUNCTIONS)
    _refuse_if(body, "function_call", lambda v: v != "none", _LEGACY_FUNCTIONS)
    _refuse_if(body, "modalities", lambda v: v != ["text"], "only text output is")
    _refuse_if(body, "audio", lambda v: True, "audio output is not implemented")
    _refuse_if(body, "prediction", lambda v: True, "predicted outputs are not implemented")
    _refuse_if(body, "web_search_options", lambda v: True, "web search is not implemented")
    _refuse_if(body, "reasoning_effort", lambda v: True, "the served model is not a reasoning model")


def _refuse_if(body: JsonObject, name: str, refused: Any, why: str) -> None:
    """400 `unsupported_parameter` when the field is set to a value that would change the output."""
    value = body.raw(name)
    if value is not None and refused(value):
        raise unsupported(body.param(name), why)
