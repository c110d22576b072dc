"""An OpenAI body's structured-output constraint → `api_pb2.StructuredOutput`.

Three spellings are accepted, at most one per request:
- OpenAI's `response_format`: `{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}`, `{"type": "json_object"}`, or `{"type": "text"}` (no constraint);
- vLLM's `structured_outputs`: an object with one of `json`, `json_object`, `regex`,
  `choice` or `grammar`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`.

Only JSON shapes are checked here; the spec itself is checked by the shared parser and
compiled by the grammar engine, whose errors are renamed to the field returned here.
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.protos.kvserve.v1 import api_pb2
from kvserve.scheduler.server.http.errors import bad_field, unsupported
from kvserve.scheduler.server.http.json_fields import JsonObject, as_list, as_object, as_string, json_type

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def structured_output(body: JsonObject) -> tuple[api_pb2.StructuredOutput | None, str]:
    """The body's constraint (None: free text) and the OpenAI field that carries it."""
    found: list[tuple[api_pb2.StructuredOutput, str]] = []
    response_format = body.child("response_format")
    if response_format is not None:
        parsed = _response_format(response_format)
        if parsed is not None:
            found.append(parsed)
    options = body.child("structured_outputs")
    if options is not None:
        found.extend(_structured_outputs(options))
    for name in _GUIDED:
        value = body.raw(name)
        if value is not None:
            found.append((_guided(name.removeprefix("guided_"), value, body.param(name)), body.param(name)))
    if not found:
        return None, "response_format"
    if len(found) > 1:
        raise bad_field(found[1][1], f"conflicts with {found[0][1]}: send one structured-output constraint")
    return found[0]


def _response_format(fmt: JsonObject) -> tuple[api_pb2.StructuredOutput, str] | None:
    kind = fmt.string("type")
    if kind is None:
        raise bad_field(fmt.param("type"), "is required")
    if kind == "text":
        return None
    if kind == "json_object":
        return api_pb2.StructuredOutput(json_object=True), fmt.param("type")
    if kind != "json_schema":
        raise unsupported(fmt.param("type"), f"{kind[:32]!r}; use text, json_object or json_schema")
    spec = fmt.child("json_schema")
    if spec is None:
        raise bad_field(fmt.param("json_schema"), 'is required with type "json_schema"')
    spec.string("name")
    spec.string("description")
    spec.boolean("strict")  # kvserve always enforces the schema, strict or not
    schema = spec.raw("schema")
    if schema is None:
        raise bad_field(spec.param("schema"), "is required")
    param = spec.param("schema")
    return api_pb2.StructuredOutput(json_schema=_schema_json(schema, param)), param


def _structured_outputs(options: JsonObject) -> list[tuple[api_pb2.StructuredOutput, str]]:
    found = []
    for kind in _STRUCTURED_KINDS:
        value = options.raw(kind)
        if value is None:
            continue
        param = options.param(kind)
        if kind == "json_object":
            if value is not True:
                raise bad_field(param, "must be true when set")
            found.append((api_pb2.StructuredOutput(json_object=True), param))
        else:
            found.append((_guided(kind, value, param), param))
    unread = options.unread()
    if unread:
        raise unsupported(unread[0], f"only {', '.join(_STRUCTURED_KINDS)} are")
    return found


def _guided(kind: str, value: Any, param: str) -> api_pb2.StructuredOutput:
    if kind == "json":
        return api_pb2.StructuredOutput(json_schema=_schema_json(value, param))
    if kind == "choice":
        choices = [as_string(c, f"{param}[{i}]") for i, c in enumerate(as_list(value, param))]
        return api_pb2.StructuredOutput(choice=api_pb2.ChoiceList(choices=choices))
    text = as_string(value, param)
    return api_pb2.StructuredOutput(regex=text) if kind == "regex" else api_pb2.StructuredOutput(grammar=text)


def _schema_json(schema: Any, param: str) -> str:
    """A schema sent as a JSON object, or (vLLM) as a string holding one; checked as JSON later."""
    if isinstance(schema, str):
        return schema
    if isinstance(schema, dict | bool):
        return json.dumps(schema, ensure_ascii=False)
    as_object(schema, param)  # raises, naming the type
    raise bad_field(param, f"must be an object, got {json_type(schema)}")
