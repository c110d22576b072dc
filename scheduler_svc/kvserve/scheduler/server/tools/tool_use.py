"""A chat request's tool use, validated once: the functions offered, the choice, the earlier calls.

`parse_tool_use` turns the `ChatPrompt`'s tools, tool_choice and parallel_tool_calls into a
frozen `ToolUse` (or None when the model may not call: no tools, or `none`), refusing a bad
field with `InvalidFieldError` naming its path ("chat.tools[0].name", "chat.tool_choice").
`parse_call` checks an assistant turn's earlier call the same way. The functions are kept as
the chat template wants them (`template_tools`) and as the grammar wants them (`schema`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from kvserve.config import defaults
from kvserve.protos.kvserve.v1 import api_pb2
from kvserve.protos.sampling import InvalidFieldError
from kvserve.protos.stop_rules import FinishReason

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for function names."""
NO_ARGUMENTS = {"type": "object", "properties": {}}
"""The schema of a function sent without `parameters` (OpenAI: an empty parameter list)."""
ChoiceMode = Literal["auto", "required", "function"]
_MODES: dict[int, ChoiceMode | Literal["none"]] = {
    api_pb2.TOOL_CHOICE_MODE_UNSPECIFIED: "auto",
    api_pb2.TOOL_CHOICE_MODE_NONE: "none",
    api_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    api_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
}

ENDS_AFTER_CALLS = frozenset({FinishReason.STOP, FinishReason.EOS, FinishReason.GRAMMAR})
"""A completion that made calls and ended in one of these reports `tool_calls`; cut off (length) it does not."""


@dataclass(frozen=True, slots=True)
class ToolFunction:
    """One function the model may call; `parameters` is its arguments' JSON Schema."""

    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made (or an earlier turn's); `arguments` is a JSON object as text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a completion may call, how it must, and the format its calls are written in."""

    tools: tuple[ToolFunction, ...]
    mode: ChoiceMode
    """auto: the model decides and its text is parsed; required: at least one call, by grammar;
    function: exactly one call of `function`, by grammar."""
    function: str | None
    parallel: bool
    """False: at most one call per completion (`parallel_tool_calls`)."""
    format: str
    """The `--tool-call-format` its calls are written and parsed in."""

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    @property
    def forced(self) -> bool:
        """True when a grammar must enforce the calls (required or a named function)."""
        return self.mode != "auto"

    @property
    def one_call(self) -> bool:
        """At most one call per completion: parallel calls are off, or a function is named (which is
        called exactly once, as OpenAI and vLLM do, whatever `parallel_tool_calls` says)."""
        return not self.parallel or self.mode == "function"

    @property
    def callable_tools(self) -> tuple[ToolFunction, ...]:
        """The functions a forced grammar allows."""
        if self.mode == "function":
            return tuple(t for t in self.tools if t.name == self.function)
        return self.tools

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as Hugging Face's `apply_chat_template(tools=...)` passes them to a template."""
        return [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
            }
            for t in self.tools
        ]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_use(chat: api_pb2.ChatPrompt, field: str, tool_format: str) -> ToolUse | None:
    """The request's tool use; None when no call may be made (no tools, or tool_choice none)."""
    choice_set = chat.HasField("tool_choice")
    if not chat.tools:
        # "none" without tools changes nothing (clients send it by default); any other choice is a mistake.
        if choice_set and chat.tool_choice.mode != api_pb2.TOOL_CHOICE_MODE_NONE:
            raise InvalidFieldError(f"{field}.tool_choice", "needs tools: there is nothing to choose from")
        return None
    if len(chat.tools) > defaults.MAX_TOOLS:
        raise InvalidFieldError(f"{field}.tools", f"at most {defaults.MAX_TOOLS} tools")
    tools = tuple(_tool(tool, f"{field}.tools[{i}]") for i, tool in enumerate(chat.tools))
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise InvalidFieldError(f"{field}.tools[{i}].name", f"{tool.name!r} is offered twice")
        seen.add(tool.name)
    mode, function = _choice(chat.tool_choice, seen, f"{field}.tool_choice") if choice_set else ("auto", None)
    if mode == "none":
        return None
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
    return ToolUse(tools=tools, mode=mode, function=function, parallel=parallel, format=tool_format)


def parse_call(call: api_pb2.ToolCall, field: str) -> dict[str, Any]:
    """An earlier assistant turn's call, as chat templates take it (arguments as an object)."""
    if not call.name:
        raise InvalidFieldError(f"{field}.name", "is required")
    try:
        arguments = json.loads(call.arguments) if call.arguments else {}
    except json.JSONDecodeError as exc:
        raise InvalidFieldError(f"{field}.arguments", f"is not valid JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise InvalidFieldError(f"{field}.arguments", "must be a JSON object")
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def _tool(tool: api_pb2.Tool, field: str) -> ToolFunction:
    if not tool.name:
        raise InvalidFieldError(f"{field}.name", "is required")
    if not NAME_PATTERN.fullmatch(tool.name):
        raise InvalidFieldError(f"{field}.name", "must be 1 to 64 letters, digits, underscores or dashes")
    parameters: Any = NO_ARGUMENTS
    if tool.parameters:
        if len(tool.parameters) > defaults.MAX_STRUCTURED_SPEC_CHARS:
            raise InvalidFieldError(f"{field}.parameters", f"at most {defaults.MAX_STRUCTURED_SPEC_CHARS} characters")
        try:
            parameters = json.loads(tool.parameters)
        except json.JSONDecodeError as exc:
            raise InvalidFieldError(f"{field}.parameters", f"is not valid JSON: {exc}") from None
        if not isinstance(parameters, dict):
            raise InvalidFieldError(f"{field}.parameters", "must be a JSON Schema object")
        if parameters.get("type", "object") != "object":
            raise InvalidFieldError(f"{field}.parameters", "must describe an object (type: object)")
    return ToolFunction(name=tool.name, description=tool.description, parameters=parameters)


def _choice(choice: api_pb2.ToolChoice, names: set[str], field: str) -> tuple[ChoiceMode | Literal["none"], str | None]:
    kind = choice.WhichOneof("choice")
    if kind == "function":
        if choice.function not in names:
            raise InvalidFieldError(f"{field}.function", f"{choice.function[:64]!r} is not one of the tools")
        return "function", choice.function
    if kind is None:
        return "auto", None
    mode = _MODES.get(choice.mode)
    if mode is None:
        raise InvalidFieldError(f"{field}.mode", f"unknown mode {choice.mode}")
    return mode, None
