"""Sampled structured output and tool calls on the real default model, at the rates users run them.

At temperature 1.0 every token is a draw over the full 49,152-token vocabulary under a grammar
mask: before the seeded noise was bounded inside (0, 1), about one draw in 350 took a token
whatever its mask, and about one of these requests in 18 failed. Each request here must come back
whole and valid, with every choice of `n`.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.services.person_requests import ask_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "happy": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "happy", "color"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": CLOCK}}]


def test_forty_seeded_json_schema_requests_with_three_choices_are_all_valid(real_model_server) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "profile", "schema": PROFILE, "strict": True}}
    prompt = [{"role": "user", "content": "Describe a person as JSON with a name, a mood and a favourite color."}]
    requests = [
        dict(messages=prompt, max_tokens=120, n=3, seed=seed, temperature=1.0, response_format=fmt)
        for seed in range(40)
    ]
    for seed, response in enumerate(ask_all(real_model_server, requests)):
        assert len(response.choices) == 3
        for choice in response.choices:
            assert choice.finish_reason == "stop", (seed, choice)
            jsonschema.validate(json.loads(choice.message.content), PROFILE)


def test_twenty_sampled_required_tool_calls_with_two_choices_are_all_valid(real_model_server) -> None:
    prompt = [{"role": "user", "content": "What time is it in Tokyo right now?"}]
    requests = [
        dict(
            messages=prompt,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            n=2,
            seed=seed,
            temperature=0.8,
        )
        for seed in range(20)
    ]
    for seed, response in enumerate(ask_all(real_model_server, requests)):
        assert len(response.choices) == 2
        for choice in response.choices:
            assert choice.finish_reason == "tool_calls", (seed, choice)
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), CLOCK)
