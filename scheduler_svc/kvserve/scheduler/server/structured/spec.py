"""A request's structured-output spec, checked for shape before any grammar engine sees it.

`structured_spec` turns the gRPC `StructuredOutput` message (which the HTTP API also
builds, from `response_format` and vLLM's extras) into a frozen `StructuredSpec`. Only
what needs no grammar engine is checked here: the schema is JSON, the regex and grammar
are non-empty, the choices are distinct non-empty strings, sizes are within limits.
What the engine refuses (an unsupported keyword, a bad regex) is found when compiling,
still before the request is queued (`compiler.GrammarCompiler`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from kvserve.config import defaults
from kvserve.protos.kvserve.v1 import api_pb2
from kvserve.protos.sampling import InvalidFieldError

SpecKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """One constraint. `text` is the schema (compact JSON), regex or grammar; `choices` for choice."""

    kind: SpecKind
    field: str
    """The API field it came from, named in every error about it (e.g. "structured.regex")."""
    text: str = ""
    choices: tuple[str, ...] = ()

    @property
    def cache_key(self) -> tuple[str, str, tuple[str, ...]]:
        """What a compiled grammar depends on (with the tokenizer): not the field it was sent in."""
        return (self.kind, self.text, self.choices)


def structured_spec(request: api_pb2.GenerateRequest) -> StructuredSpec | None:
    """The request's constraint, or None; raise InvalidFieldError naming the bad field."""
    if not request.HasField("structured"):
        return None
    msg = request.structured
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidFieldError("structured", "set one of json_schema, json_object, regex, choice or grammar")
    field = f"structured.{kind}"
    if kind == "json_schema":
        return StructuredSpec("json_schema", field, text=_schema_text(msg.json_schema, field))
    if kind == "json_object":
        if not msg.json_object:
            raise InvalidFieldError(field, "set it to true, or leave structured unset")
        return StructuredSpec("json_object", field)
    if kind == "choice":
        return StructuredSpec("choice", field, choices=_choices(list(msg.choice.choices), field))
    text = msg.regex if kind == "regex" else msg.grammar
    _check_size(text, field)
    return StructuredSpec(kind, field, text=text)


def _schema_text(raw: str, field: str) -> str:
    _check_size(raw, field)
    try:
        schema = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidFieldError(field, f"is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise InvalidFieldError(field, "must be a JSON object (a JSON Schema) or a boolean")
    # Key order is kept: the properties are generated in the order the schema lists them.
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _choices(choices: list[str], field: str) -> tuple[str, ...]:
    if not choices:
        raise InvalidFieldError(field, "needs at least one choice")
    if len(choices) > defaults.MAX_STRUCTURED_CHOICES:
        raise InvalidFieldError(field, f"at most {defaults.MAX_STRUCTURED_CHOICES} choices")
    if any(not c for c in choices):
        raise InvalidFieldError(field, "choices must not be empty strings")
    _check_size("".join(choices), field)
    return tuple(dict.fromkeys(choices))


def _check_size(text: str, field: str) -> None:
    if not text:
        raise InvalidFieldError(field, "must not be empty")
    if len(text) > defaults.MAX_STRUCTURED_SPEC_CHARS:
        raise InvalidFieldError(field, f"at most {defaults.MAX_STRUCTURED_SPEC_CHARS} characters")
