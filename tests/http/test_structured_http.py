"""Structured output over the OpenAI HTTP API, spoken by the official `openai` SDK (fake executor).

`response_format` (json_schema, json_object, text), vLLM's `structured_outputs` and the older
`guided_*` extras each reach the same compiled constraint; bad specs are a 400 naming the
field the client sent, before any token, and the server stays healthy.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.http.http_clients import sdk

pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no", "it depends"]}, "confidence": {"enum": ["low", "high"]}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "Is water wet?"}]


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_response_format_json_schema_returns_schema_valid_json(http_server) -> None:
    client = sdk(http_server)
    response = client.chat.completions.create(
        model=_model(client),
        messages=USER,
        max_tokens=80,
        n=3,
        seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}},
    )
    for choice in response.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"


def test_vllm_extras_choice_and_regex_on_both_endpoints(http_server) -> None:
    client = sdk(http_server)
    model = _model(client)
    chat = client.chat.completions.create(
        model=model, messages=USER, max_tokens=20, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert chat.choices[0].message.content in ("yes", "no")
    legacy = client.completions.create(
        model=model, prompt="The answer:", max_tokens=20, extra_body={"guided_regex": r"(red|blue)-(1|2|3)"}
    )
    assert re.fullmatch(r"(red|blue)-(1|2|3)", legacy.choices[0].text) and legacy.choices[0].finish_reason == "stop"
    legacy_choice = client.completions.create(
        model=model, prompt="x", max_tokens=20, extra_body={"guided_choice": ["left", "right"]}
    )
    assert legacy_choice.choices[0].text in ("left", "right")


def test_a_streamed_choice_arrives_whole(http_server) -> None:
    client = sdk(http_server)
    stream = client.chat.completions.create(
        model=_model(client),
        messages=USER,
        max_tokens=40,
        stream=True,
        extra_body={"structured_outputs": {"choice": ["absolutely, without a doubt", "no"]}},
    )
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text in ("absolutely, without a doubt", "no") and finish == "stop"


def test_response_format_text_is_free_text(http_server) -> None:
    client = sdk(http_server)
    response = client.chat.completions.create(
        model=_model(client), messages=USER, max_tokens=5, response_format={"type": "text"}
    )
    assert response.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{oops"}}},
            "response_format.json_schema.schema",
            "not valid JSON",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "propertyNames": {"pattern": "a"}}},
                }
            },
            "response_format.json_schema.schema",
            "propertyNames",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "regex"),
        ({"guided_regex": "[z-a]"}, "guided_regex", "regex"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "not supported"),
        (
            {"response_format": {"type": "json_object"}, "guided_choice": ["a"]},
            "guided_choice",
            "one structured-output constraint",
        ),
    ],
    ids=["invalid-json", "unsupported-keyword", "invalid-regex", "legacy-invalid-regex", "no-schema", "unknown", "two"],
)
def test_bad_specs_are_a_400_naming_the_field_and_the_server_stays_healthy(
    http_server, body: dict, param: str, message: str
) -> None:
    client = sdk(http_server)
    model = _model(client)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=USER, max_tokens=5, extra_body=body, stream=True)
    error = caught.value.body
    assert error["param"] == param and message in error["message"], error
    assert httpx.get(f"{http_server.http_url}/health", timeout=10).status_code == 200
    ok = client.chat.completions.create(
        model=model, messages=USER, max_tokens=5, extra_body={"guided_choice": ["fine"]}
    )
    assert ok.choices[0].message.content == "fine"
    assert "Traceback" not in http_server.log_text()
