"""Parse a `GenerateRequest` into an immutable `ValidatedRequest`, refusing bad fields.

This is the one place a request is checked: past it, the engine and the scheduler take
the request as given (the core only asserts its preconditions). Every refusal raises
`InvalidFieldError` whose `field` is the API field path (e.g. "sampling.top_p"), which
the API maps to INVALID_ARGUMENT "field: message". The value ranges of the sampling
fields are defined by `SamplingParams.validate` (given the vocabulary size, for `logit_bias`);
this module adds what else needs the model: context length, vocabulary, chat template, roles
and tools (a forced tool choice becomes the request's grammar), and, first, the model the request
names (the base model or a LoRA adapter: `served_models.ServedModels`). What needs the KV pool
(does it ever fit?) is known only to the scheduler and is refused there, as capacity.

Unset sampling fields take `ModelLimits.sampling_defaults` (the model's
generation_config.json where it sets them, else the API's defaults: generation_defaults.py).
`top_k = 0` means off, as in Hugging Face and vLLM; it is stored as -1, the one off value
SamplingParams and the executor know.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import defaults
from kvserve.protos.kvserve.v1 import api_pb2
from kvserve.protos.sampling import InvalidFieldError, SamplingParams
from kvserve.scheduler.server.intake.generation_defaults import SamplingDefaults
from kvserve.scheduler.server.intake.served_models import BASE_MODEL, ServedModels
from kvserve.scheduler.server.intake.tokenizer import CHAT_ROLES, ChatMessage, ChatTemplateError, Tokenizer
from kvserve.scheduler.server.structured.spec import StructuredSpec, structured_spec
from kvserve.scheduler.server.tools.tool_formats import FORMATS
from kvserve.scheduler.server.tools.tool_use import ToolUse, parse_call, parse_tool_use

_SAMPLING_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_SAMPLING_INTS = ("top_k", "seed", "n", "min_tokens", "logprobs")
_MODEL_DEFAULTED = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
"""The fields whose unset value comes from `SamplingDefaults` rather than SamplingParams."""
_TOP_K_OFF = SamplingParams().top_k


@dataclass(slots=True)
class ModelLimits:
    """What parsing checks against: the served model's limits and the server's request size,
    and the defaults of unset sampling fields (`load_sampling_defaults(model_dir)`)."""

    max_model_len: int
    vocab_size: int
    max_request_bytes: int = defaults.MAX_REQUEST_BYTES
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    tool_call_format: str = defaults.TOOL_CALL_FORMAT
    models: ServedModels = field(default_factory=ServedModels)
    """The names a request's `model` may give: the base model's and the LoRA adapters'."""


@dataclass(frozen=True, slots=True)
class ValidatedRequest:
    """A request that passed every field check; frozen so nothing downstream can un-validate it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int
    cache_salt: str
    structured: StructuredSpec | None = None
    """Structured output, shape-checked; compiled (and refused if the engine cannot) before queueing."""
    tools: ToolUse | None = None
    """The calls a chat completion may make; its text is parsed for them."""
    lora_name: str = BASE_MODEL
    """The LoRA adapter it runs under ("": the base model); its prefix cache is the adapter's own."""
    lora_id: int = 0
    """That adapter's id when the request was parsed (`ServedModels.lora_id`; 0: the base model)."""


def parse_generate(request: api_pb2.GenerateRequest, tokenizer: Tokenizer, limits: ModelLimits) -> ValidatedRequest:
    """Check every field and tokenize the prompt; raise InvalidFieldError naming the first bad one
    (its subclass ModelNotFound when the request names a model this server does not serve)."""
    models = limits.models  # one snapshot: a runtime load or unload replaces it
    lora_name = models.resolve(request.model)
    size = request.ByteSize()
    if size > limits.max_request_bytes:
        # The prompt is what makes a request big, so name it; gRPC itself refuses far larger
        # messages (see grpc_api.TRANSPORT_SIZE_FACTOR) with RESOURCE_EXHAUSTED.
        raise InvalidFieldError(
            request.WhichOneof("prompt") or "request",
            f"request of {size} bytes is over the {limits.max_request_bytes}-byte limit",
        )
    request_id = validate_request_id(request.request_id)
    if len(request.cache_salt) > defaults.MAX_CACHE_SALT_CHARS:
        raise InvalidFieldError("cache_salt", f"at most {defaults.MAX_CACHE_SALT_CHARS} characters")
    if abs(request.priority) > defaults.MAX_ABS_PRIORITY:
        raise InvalidFieldError("priority", f"must be within ±{defaults.MAX_ABS_PRIORITY}, got {request.priority}")
    tools = None
    if request.WhichOneof("prompt") == "chat":
        tools = parse_tool_use(request.chat, "chat", limits.tool_call_format)
    prompt = prompt_token_ids(request, tokenizer, limits, tools)
    sampling = sampling_params(request.sampling, len(prompt), limits)
    return ValidatedRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        sampling=sampling,
        priority=int(request.priority),
        cache_salt=request.cache_salt,
        structured=_constraint(request, tools),
        tools=tools,
        lora_name=lora_name,
        lora_id=models.lora_id(lora_name),
    )


def _constraint(request: api_pb2.GenerateRequest, tools: ToolUse | None) -> StructuredSpec | None:
    """The request's own structured output, or the grammar of a forced tool choice (never both)."""
    if tools is None or not tools.forced:
        return structured_spec(request)
    if request.HasField("structured"):
        raise InvalidFieldError(
            "structured", "cannot be combined with tool_choice required or a named function, whose calls are the output"
        )
    grammar = FORMATS[tools.format].forced_grammar(tools)
    if len(grammar) > defaults.MAX_STRUCTURED_SPEC_CHARS:
        limit = defaults.MAX_STRUCTURED_SPEC_CHARS
        raise InvalidFieldError("chat.tools", f"the tools' schemas are over {limit} characters in all")
    return StructuredSpec("grammar", "chat.tools", text=grammar)


def validate_request_id(request_id: str) -> str:
    if not request_id:
        return uuid.uuid4().hex
    if len(request_id) > defaults.MAX_REQUEST_ID_CHARS:
        raise InvalidFieldError("request_id", f"at most {defaults.MAX_REQUEST_ID_CHARS} characters")
    if not request_id.isprintable() or not request_id.isascii():
        raise InvalidFieldError("request_id", "must be printable ASCII")
    return request_id


def prompt_token_ids(
    request: api_pb2.GenerateRequest, tokenizer: Tokenizer, limits: ModelLimits, tools: ToolUse | None = None
) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        ids = encode_text(request.text, tokenizer, "text")
    elif kind == "token_ids":
        ids = list(request.token_ids.ids)
        bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise InvalidFieldError("token_ids", f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    elif kind == "chat":
        ids = encode_chat(request.chat, tokenizer, "chat", tools)
    else:
        raise InvalidFieldError("prompt", "set one of text, token_ids or chat")
    if not ids:
        raise InvalidFieldError(kind, "the prompt must not be empty")
    if len(ids) >= limits.max_model_len:
        raise InvalidFieldError(
            kind,
            f"the prompt has {len(ids)} tokens; the context holds {limits.max_model_len} "
            "and at least one must be left for the output",
        )
    return ids


def encode_text(text: str, tokenizer: Tokenizer, field: str) -> list[int]:
    if not text:
        raise InvalidFieldError(field, "the prompt must not be empty")
    if len(text) > defaults.MAX_PROMPT_CHARS:
        raise InvalidFieldError(field, f"at most {defaults.MAX_PROMPT_CHARS} characters")
    return tokenizer.encode(text)


def encode_chat(chat: api_pb2.ChatPrompt, tokenizer: Tokenizer, field: str, tools: ToolUse | None = None) -> list[int]:
    """The chat prompt's ids; the tools are shown to the model only when it may call them."""
    messages = chat.messages
    if not messages:
        raise InvalidFieldError(f"{field}.messages", "at least one message is required")
    if len(messages) > defaults.MAX_CHAT_MESSAGES:
        raise InvalidFieldError(f"{field}.messages", f"at most {defaults.MAX_CHAT_MESSAGES} messages")
    total = 0
    parsed = []
    for i, message in enumerate(messages):
        parsed.append(_chat_message(message, f"{field}.messages[{i}]"))
        total += len(message.content) + sum(len(c.arguments) for c in message.tool_calls)
    if total > defaults.MAX_PROMPT_CHARS:
        raise InvalidFieldError(f"{field}.messages", f"at most {defaults.MAX_PROMPT_CHARS} characters in all")
    try:
        return tokenizer.encode_chat(parsed, tools.template_tools() if tools is not None else None)
    except ChatTemplateError as exc:
        raise InvalidFieldError(f"{field}.tools" if tools is not None else field, str(exc)) from exc


def _chat_message(message: api_pb2.ChatMessage, field: str) -> ChatMessage:
    if message.role not in CHAT_ROLES:
        raise InvalidFieldError(f"{field}.role", f"unknown role {message.role[:32]!r}; use one of {sorted(CHAT_ROLES)}")
    if message.tool_calls and message.role != "assistant":
        raise InvalidFieldError(f"{field}.tool_calls", "only an assistant turn makes tool calls")
    if message.role == "tool" and not message.tool_call_id:
        raise InvalidFieldError(f"{field}.tool_call_id", "is required in a tool turn")
    calls = tuple(parse_call(call, f"{field}.tool_calls[{j}]") for j, call in enumerate(message.tool_calls))
    return ChatMessage(message.role, message.content, tool_calls=calls, tool_call_id=message.tool_call_id)


def sampling_params(pb: api_pb2.SamplingParams, prompt_len: int, limits: ModelLimits) -> SamplingParams:
    """Proto -> SamplingParams; unset fields take the model's defaults, max_tokens is clamped only when unset."""
    model_defaults = limits.sampling_defaults
    given: dict[str, Any] = {name: getattr(model_defaults, name) for name in _MODEL_DEFAULTED}
    given.update({name: float(getattr(pb, name)) for name in _SAMPLING_FLOATS if pb.HasField(name)})
    given.update({name: int(getattr(pb, name)) for name in _SAMPLING_INTS if pb.HasField(name)})
    if given["top_k"] == 0:
        given["top_k"] = _TOP_K_OFF
    room = limits.max_model_len - prompt_len
    if pb.HasField("max_tokens"):
        max_tokens = int(pb.max_tokens)
        if max_tokens > room:
            raise InvalidFieldError(
                "sampling.max_tokens",
                f"prompt ({prompt_len} tokens) + max_tokens "
                f"({max_tokens}) exceeds the context of {limits.max_model_len} tokens",
            )
    else:
        max_tokens = min(model_defaults.max_tokens, room)
    stop_token_ids = tuple(int(t) for t in pb.stop_token_ids)
    if any(not 0 <= t < limits.vocab_size for t in stop_token_ids):
        raise InvalidFieldError("sampling.stop_token_ids", f"token ids must be in [0, {limits.vocab_size})")
    params = SamplingParams(
        **given,
        max_tokens=max_tokens,
        stop_token_ids=stop_token_ids,
        stop=tuple(pb.stop),
        ignore_eos=bool(pb.ignore_eos),
        logit_bias=tuple(sorted(pb.logit_bias.items())),
    )
    try:
        params.validate(vocab_size=limits.vocab_size)
    except InvalidFieldError as exc:
        raise InvalidFieldError(f"sampling.{exc.field}", exc.reason) from exc
    return params
