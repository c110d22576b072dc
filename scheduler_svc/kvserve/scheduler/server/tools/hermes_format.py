"""The `hermes` tool-call format: each call a JSON object between `<tool_call>` tags.

A completion that calls writes, for each call,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

This is the format Hermes-, Qwen2- and most ChatML-trained models use; the fallback chat
template (`templates/hermes.jinja`) shows the tools and earlier calls the same way. Three parts:
the grammar that forces calls (`forced_grammar`), the streaming parser that takes calls out of
the text (`HermesParser`), and the template (loaded by `tool_formats`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import defaults
from kvserve.scheduler.server.structured.llguidance_backend import JSON_OPTIONS
from kvserve.scheduler.server.tools.tool_use import ToolCall, ToolFunction, ToolUse, new_call_id

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_WHITESPACE = " \t\r\n"


def fits(template: str | None) -> bool:
    """Whether the fallback template can stand in for this model's: it writes ChatML turns."""
    return template is not None and "<|im_start|>" in template


def forced_grammar(use: ToolUse) -> str:
    """An llguidance Lark grammar: one call (or, for `required` with parallel calls, up to MAX_PARALLEL_TOOL_CALLS)
    of the allowed functions, each call's arguments generated from its schema, so they always validate."""
    bodies = [f"%json {json.dumps(_call_schema(t), ensure_ascii=False)}" for t in use.callable_tools]
    more = defaults.MAX_PARALLEL_TOOL_CALLS - 1
    calls = "call" if use.one_call else f'call ("\\n" call){{0,{more}}}'
    return f'start: {calls}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\n' + "body: " + "\n    | ".join(bodies) + "\n"


def _call_schema(tool: ToolFunction) -> dict[str, Any]:
    """`{"name": <this tool>, "arguments": <its parameters>}`, name first; the parameters' own
    definitions move to the root, where their `#/$defs/...` references resolve."""
    parameters = dict(tool.parameters)
    hoisted: dict[str, Any] = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **hoisted,
        "x-guidance": JSON_OPTIONS,
    }


@dataclass(slots=True)
class Parsed:
    """What one piece of text turned into: text for `content`, and the calls it completed."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class HermesParser:
    """Takes calls out of a completion's text as it streams, whatever the chunking.

    Text outside the tags is content. A tag split across chunks is held back until it is
    known, so markup never reaches content; so is trailing whitespace, which is dropped
    before a call and at the end of a completion that made one (content is then empty, so
    null, when only calls were made). A call
    whose body is not a JSON object naming one of the tools, with object arguments, is
    returned as the text it was, tags included, never as a broken call. With `parallel`
    off, the completion is over after its first call (`done`): the caller stops it.
    """

    def __init__(self, names: frozenset[str], parallel: bool, new_id: Callable[[], str] = new_call_id) -> None:
        self._names = names
        self._parallel = parallel
        self._new_id = new_id
        self._buffer = ""
        self._in_call = False
        self._held_whitespace = ""
        self.calls_made = 0
        self.done = False

    def push(self, text: str) -> Parsed:
        out = Parsed()
        if self.done or not text:
            return out
        self._buffer += text
        while not self.done:
            if not self._in_call:
                start = self._buffer.find(OPEN)
                if start < 0:
                    keep = _partial_tag(self._buffer, OPEN)
                    self._emit(out, self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                self._emit(out, self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN) :]
                self._in_call = True
            else:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    break
                body = self._buffer[:end]
                self._buffer = self._buffer[end + len(CLOSE) :]
                self._in_call = False
                self._settle(out, body, OPEN + body + CLOSE)
        return out

    def finish(self) -> Parsed:
        """The end of the completion: an unclosed call still counts if its body is whole."""
        out = Parsed()
        if not self.done:
            rest, self._buffer = self._buffer, ""
            if self._in_call:
                self._in_call = False
                self._settle(out, rest, OPEN + rest)
            else:
                self._emit(out, rest)
        if self.calls_made == 0:
            out.content += self._held_whitespace
        self._held_whitespace = ""
        return out

    def _settle(self, out: Parsed, body: str, as_text: str) -> None:
        call = self._call(body)
        if call is None:
            self._emit(out, as_text)
            return
        out.calls.append(call)
        self.calls_made += 1
        self._held_whitespace = ""  # what separated text from a call is markup too
        if not self._parallel:
            self.done = True
            self._buffer = ""

    def _emit(self, out: Parsed, text: str) -> None:
        text = self._held_whitespace + text
        visible = text.rstrip(_WHITESPACE)
        self._held_whitespace = text[len(visible) :]
        out.content += visible

    def _call(self, body: str) -> ToolCall | None:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or "name" not in value or "arguments" not in value:
            return None
        name, arguments = value["name"], value["arguments"]
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if name not in self._names or not isinstance(arguments, dict):
            return None
        return ToolCall(id=self._new_id(), name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that a later chunk could complete into `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
