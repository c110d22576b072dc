"""Tool calling with the default model (SmolLM2-135M) through the official `openai` SDK.

The model was not trained on tool calls, so `required` and a named function are the honest tests:
the grammar makes its calls valid whatever it would have written (and a named function is called
exactly once); greedy streaming reassembles to the same call, and the result turn reaches the next
prompt. Every test only sends requests, to the session's shared server (`real_model_server`).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.http.http_clients import sdk

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": WEATHER}}
]
USER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 40}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TIME_TOOLS = [
    *TOOLS,
    {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": TIME}},
]


def test_the_default_model_makes_valid_required_calls_streamed_alike_and_reads_the_result(real_model_server) -> None:
    client = sdk(real_model_server)
    model = client.models.list().data[0].id
    kwargs = {"model": model, "messages": USER, "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    first = client.chat.completions.create(max_tokens=120, parallel_tool_calls=False, **kwargs)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    streamed = ""
    for chunk in client.chat.completions.create(max_tokens=120, parallel_tool_calls=False, stream=True, **kwargs):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            streamed += delta.function.arguments or ""
    assert streamed == call.function.arguments  # greedy: token for token the same call

    result = "18 degrees and sunny"
    turns = [
        *USER,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    answer = client.chat.completions.create(model=model, messages=turns, tools=TOOLS, temperature=0, max_tokens=30)
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
    bare = client.chat.completions.create(
        model=model,
        messages=[*turns[:-1], {"role": "tool", "tool_call_id": call.id, "content": ""}],
        tools=TOOLS,
        max_tokens=1,
    )
    # The result's tokens are in the prompt: the same conversation with an empty result is shorter.
    assert answer.usage.prompt_tokens > bare.usage.prompt_tokens


def test_a_named_function_is_called_exactly_once_by_the_default_model(real_model_server) -> None:
    """As OpenAI and vLLM: one call of the named function, even with parallel calls allowed (the
    default model used to write a second call of it when the grammar let it)."""
    client = sdk(real_model_server)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What time is it in Tokyo and in Paris?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2}):
        response = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TIME_TOOLS,
            tool_choice=named,
            parallel_tool_calls=True,
            max_tokens=120,
            **sampling,
        )
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", (sampling, choice)
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), TIME)
