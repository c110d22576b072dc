"""The OpenAI spelling of tool calling → the `ChatPrompt` and `ChatMessage` tool fields.

Only JSON types and OpenAI's nesting are checked here (`tools[i].function.name` is a string,
`parameters` an object, `tool_choice` one of its four shapes); names, schemas and the choice
against the tools are checked by the shared validation (`tools.tool_use`), whose gRPC field
paths `field_names` turns back into these names.
"""

from __future__ import annotations

import json

from kvserve.protos.kvserve.v1 import api_pb2
from kvserve.scheduler.server.http.errors import bad_field, unsupported
from kvserve.scheduler.server.http.json_fields import JsonObject, as_object, json_type

_MODES = {
    "none": api_pb2.TOOL_CHOICE_MODE_NONE,
    "auto": api_pb2.TOOL_CHOICE_MODE_AUTO,
    "required": api_pb2.TOOL_CHOICE_MODE_REQUIRED,
}
_CHOICE_SHAPES = 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


def read_tools(body: JsonObject, chat: api_pb2.ChatPrompt, unknown: list[str]) -> None:
    """`tools`, `tool_choice` and `parallel_tool_calls` onto the chat prompt."""
    for i, item in enumerate(body.array("tools") or []):
        tool = JsonObject(as_object(item, f"tools[{i}]"), prefix=f"tools[{i}].")
        _require_function_type(tool)
        function = tool.child("function")
        if function is None:
            raise bad_field(tool.param("function"), "is required")
        parameters = function.raw("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_field(function.param("parameters"), f"must be a JSON Schema object, got {json_type(parameters)}")
        function.boolean("strict")  # arguments are enforced by grammar for required and named choices
        chat.tools.add(
            name=function.string("name") or "",
            description=function.string("description") or "",
            parameters=json.dumps(parameters, ensure_ascii=False) if parameters is not None else "",
        )
        unknown.extend(tool.unread() + function.unread())
    choice = body.raw("tool_choice")
    if isinstance(choice, str):
        if choice not in _MODES:
            raise bad_field("tool_choice", f"{_CHOICE_SHAPES}, not {choice[:32]!r}")
        chat.tool_choice.mode = _MODES[choice]
    elif choice is not None:
        named = JsonObject(as_object(choice, "tool_choice"), prefix="tool_choice.")
        _require_function_type(named)
        function = named.child("function")
        name = function.string("name") if function is not None else None
        if name is None:
            raise bad_field("tool_choice.function.name", f"is required: tool_choice {_CHOICE_SHAPES}")
        chat.tool_choice.function = name
    parallel = body.boolean("parallel_tool_calls")
    if parallel is not None:
        chat.parallel_tool_calls = parallel


def read_message_tools(message: JsonObject, pb: api_pb2.ChatMessage) -> None:
    """An assistant turn's `tool_calls`, a tool turn's `tool_call_id`."""
    for j, item in enumerate(message.array("tool_calls") or []):
        call = JsonObject(as_object(item, message.param(f"tool_calls[{j}]")), prefix=message.param(f"tool_calls[{j}]."))
        _require_function_type(call)
        function = call.child("function")
        if function is None:
            raise bad_field(call.param("function"), "is required")
        pb.tool_calls.add(
            id=call.string("id") or "", name=function.string("name") or "", arguments=_arguments(function)
        )
    tool_call_id = message.string("tool_call_id")
    if tool_call_id is not None:
        pb.tool_call_id = tool_call_id


def _arguments(function: JsonObject) -> str:
    """OpenAI sends arguments as JSON text; an object sent as such is accepted too."""
    value = function.raw("arguments")
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    raise bad_field(function.param("arguments"), f"must be a JSON object as a string, got {json_type(value)}")


def _require_function_type(obj: JsonObject) -> None:
    kind = obj.raw("type")
    if kind is None:
        return  # OpenAI requires it; only "function" exists, so leaving it out is harmless
    if kind != "function":
        raise unsupported(obj.param("type"), f"only function tools are, not {str(kind)[:32]!r}")


def message_content_optional(message: JsonObject) -> bool:
    """An assistant turn that makes calls may leave `content` null (OpenAI does)."""
    return bool(message.raw("tool_calls"))
