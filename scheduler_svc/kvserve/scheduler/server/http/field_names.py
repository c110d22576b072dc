"""The one table from gRPC field paths to OpenAI parameter names, for errors of the shared validation.

`parse_generate` names a bad field by its path in `GenerateRequest` ("sampling.top_p",
"chat.messages[0].role", "token_ids"); an OpenAI client expects the name it sent
("top_p", "messages[0].role", "prompt"). Three names depend on the request: the prompt
("prompt", or "prompt[2]" for the third of several), the length limit ("max_tokens" or
"max_completion_tokens", whichever was sent), the logprobs count ("top_logprobs" in
chat, "logprobs" in completions) and the structured-output constraint (wherever it was
sent: "response_format.json_schema.schema", "guided_regex", ...); the table holds a
placeholder for each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PROMPT = "<prompt>"
MAX_TOKENS = "<max_tokens>"
LOGPROBS = "<logprobs>"
STRUCTURED = "<structured>"

GRPC_TO_OPENAI: dict[str, str] = {
    "text": PROMPT,
    "token_ids": PROMPT,
    "prompt": PROMPT,
    "request": PROMPT,  # the whole message over --max-request-bytes: the prompt made it big
    "chat": "messages",
    "chat.messages": "messages",
    "sampling.max_tokens": MAX_TOKENS,
    "sampling.logprobs": LOGPROBS,
    "sampling.temperature": "temperature",
    "sampling.top_k": "top_k",
    "sampling.top_p": "top_p",
    "sampling.min_p": "min_p",
    "sampling.repetition_penalty": "repetition_penalty",
    "sampling.presence_penalty": "presence_penalty",
    "sampling.frequency_penalty": "frequency_penalty",
    "sampling.seed": "seed",
    "sampling.n": "n",
    "sampling.min_tokens": "min_tokens",
    "sampling.stop_token_ids": "stop_token_ids",
    "sampling.stop": "stop",
    "sampling.ignore_eos": "ignore_eos",
    "sampling.logit_bias": "logit_bias",
    "priority": "priority",
    "cache_salt": "cache_salt",
    "model": "model",
    "structured": STRUCTURED,
    "structured.json_schema": STRUCTURED,
    "structured.json_object": STRUCTURED,
    "structured.regex": STRUCTURED,
    "structured.choice": STRUCTURED,
    "structured.grammar": STRUCTURED,
}
"""Every field path the shared validation can name; `chat.messages[i]...` is mapped by prefix."""

_TOOL_PATHS = (
    (re.compile(r"^chat\.tools\[(\d+)\]\.(name|parameters|description)$"), r"tools[\1].function.\2"),
    (re.compile(r"^chat\.(tools.*)$"), r"\1"),
    (re.compile(r"^chat\.tool_choice\.function$"), "tool_choice.function.name"),
    (re.compile(r"^chat\.tool_choice(\.mode)?$"), "tool_choice"),
    (re.compile(r"^chat\.(messages\[\d+\]\.tool_calls\[\d+\])\.(name|arguments)$"), r"\1.function.\2"),
)
"""The tool fields' paths, whose OpenAI names nest differently (`tools[0].function.name`)."""

_CAPACITY_FIELDS = {"prompt": "prompt", "max_tokens": "sampling.max_tokens"}
"""The scheduler's own names in `RequestRejected` (it alone knows whether a request can ever fit)."""


@dataclass(frozen=True, slots=True)
class ParamNames:
    """The request-dependent OpenAI names of one prompt's request."""

    prompt: str = "prompt"
    max_tokens: str = "max_tokens"
    logprobs: str = "logprobs"
    structured: str = "response_format"


def openai_param(grpc_field: str, names: ParamNames) -> str:
    """The OpenAI name of a gRPC field path; an unmapped path loses only its `sampling.` prefix."""
    for pattern, replacement in _TOOL_PATHS:
        renamed, count = pattern.subn(replacement, grpc_field)
        if count:
            return renamed
    if grpc_field.startswith("chat.messages["):
        return grpc_field.removeprefix("chat.")
    mapped = GRPC_TO_OPENAI.get(grpc_field, grpc_field.removeprefix("sampling."))
    placeholders = {
        PROMPT: names.prompt,
        MAX_TOKENS: names.max_tokens,
        LOGPROBS: names.logprobs,
        STRUCTURED: names.structured,
    }
    return placeholders.get(mapped, mapped)


def capacity_param(scheduler_field: str, names: ParamNames) -> str:
    """The OpenAI name of the field a scheduler capacity refusal (`RequestRejected.field`) is about."""
    return openai_param(_CAPACITY_FIELDS.get(scheduler_field, scheduler_field), names)
