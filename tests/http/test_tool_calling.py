"""Tool calling over the OpenAI HTTP API, through the official `openai` SDK (fake executor).

The fake executor samples under the grammar's mask like the real one, so `required` and named
choices must give calls whose arguments validate, whatever it picks (and it picks a second call
whenever the grammar allows one); streaming must reassemble to the same calls; the tool-result
turn must reach the prompt. For `auto` and `none` the fake writes what a test scripts
(`--scripted-replies`: a prompt holding `[[fake-reply]]TEXT[[/fake-reply]]` is answered with TEXT),
so the parsing of well-formed and malformed markup is checked for real.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from kvserve.testing.server_launcher import ServeProcess, serving
from tests.http.http_clients import FAKE_ARGS, sdk

pytestmark = pytest.mark.timeout(300)

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"enum": ["A1", "B2"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 2,
        },
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
        "express": {"type": "boolean"},
    },
    "required": ["items", "address", "express"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "place_order", "description": "Order items", "parameters": ORDER}},
]
SCHEMAS = {"get_weather": WEATHER, "place_order": ORDER}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
"""A well-formed hermes call body."""


@pytest.fixture(scope="module")
def _http_server_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """This module's fake-executor server (HTTP on, lent to each test as `http_server`) with
    `--scripted-replies`; unscripted prompts are answered as on any fake server."""
    args = [*FAKE_ARGS, "--scripted-replies"]
    with serving(args, tmp_path_factory.mktemp("tool-calling"), http=True) as server:
        yield server


def _scripted(reply: str) -> list[dict]:
    """A user turn whose answer (on this module's server) is exactly `reply`."""
    return [{"role": "user", "content": f"What is the weather in Paris?[[fake-reply]]{reply}[[/fake-reply]]"}]


def _create(client: openai.OpenAI, **kwargs):
    kwargs.setdefault("max_tokens", 1000)
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=kwargs.pop("messages", USER), **kwargs
    )


def _validate(calls) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("name", ["get_weather", "place_order"])
def test_a_named_choice_calls_that_function_with_valid_arguments(http_server, name: str) -> None:
    response = _create(sdk(http_server), tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}})
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    _validate(choice.message.tool_calls)
    assert [c.function.name for c in choice.message.tool_calls] == [name]


def test_a_named_choice_makes_exactly_one_call_even_with_parallel_calls_allowed(http_server) -> None:
    """As OpenAI and vLLM: one call of the named function. The fake draws a second call wherever the
    grammar allows one, so a grammar that allowed parallel calls would show here at once."""
    client = sdk(http_server)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        response = _create(
            client, tools=TOOLS, tool_choice=named, parallel_tool_calls=True, n=2, seed=seed, temperature=1
        )
        for choice in response.choices:
            assert choice.finish_reason == "tool_calls"
            _validate(choice.message.tool_calls)
            assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    streamed: set[int] = set()
    for chunk in _create(client, tools=TOOLS, tool_choice=named, stream=True, seed=7, temperature=1):
        for choice in chunk.choices:
            streamed |= {delta.index for delta in choice.delta.tool_calls or []}
    assert streamed == {0}


def test_required_with_n_2_gives_each_choice_its_own_valid_calls(http_server) -> None:
    response = _create(sdk(http_server), tools=TOOLS, tool_choice="required", n=2, seed=3, temperature=1.0)
    assert len(response.choices) == 2
    ids = set()
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        _validate(choice.message.tool_calls)
        ids |= {c.id for c in choice.message.tool_calls}
    assert len(ids) == sum(len(c.message.tool_calls) for c in response.choices)


def test_without_parallel_calls_there_is_exactly_one_call(http_server) -> None:
    for seed in range(3):
        response = _create(
            sdk(http_server), tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed, temperature=1
        )
        calls = response.choices[0].message.tool_calls
        _validate(calls)
        assert len(calls) == 1


def test_streamed_deltas_reassemble_to_the_non_streamed_calls(http_server) -> None:
    client = sdk(http_server)
    kwargs = {"tools": TOOLS, "tool_choice": "required", "temperature": 0}
    whole = _create(client, **kwargs).choices[0].message.tool_calls
    streamed: dict[int, dict] = {}
    finish = None
    for chunk in _create(client, stream=True, **kwargs):
        for choice in chunk.choices:
            assert not choice.delta.content  # no markup, no text: only calls
            for delta in choice.delta.tool_calls or []:
                entry = streamed.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id is not None:
                    assert entry["id"] is None, "the id comes once, in the first delta"
                    entry["id"], entry["name"] = delta.id, delta.function.name
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [(e["name"], e["arguments"]) for _, e in sorted(streamed.items())] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


def test_a_tool_result_round_trip_puts_the_result_in_the_next_prompt(http_server) -> None:
    client = sdk(http_server)
    first = _create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    turns = [*USER, first.choices[0].message.model_dump(exclude_none=True)]
    short = [*turns, {"role": "tool", "tool_call_id": call.id, "content": "18"}]
    long = [*turns, {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny, light wind from the west"}]
    answers = [_create(client, messages=m, tools=TOOLS, max_tokens=5) for m in (short, long)]
    assert answers[0].usage.prompt_tokens > first.usage.prompt_tokens
    assert answers[1].usage.prompt_tokens > answers[0].usage.prompt_tokens  # the result's text is in the prompt


def test_auto_turns_well_formed_markup_into_calls_streamed_alike(http_server) -> None:
    client = sdk(http_server)
    reply = f"Let me look that up.\n<tool_call>\n{PARIS}\n</tool_call>"
    choice = _create(client, messages=_scripted(reply), tools=TOOLS, tool_choice="auto").choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look that up."  # the markup never reaches content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    _validate([call])

    content, arguments, finish = "", "", None
    for chunk in _create(client, messages=_scripted(reply), tools=TOOLS, stream=True):  # auto by default
        for streamed in chunk.choices:
            content += streamed.delta.content or ""
            for delta in streamed.delta.tool_calls or []:
                assert delta.index == 0
                arguments += delta.function.arguments or ""
            finish = streamed.finish_reason or finish
    assert (content, arguments, finish) == ("Let me look that up.", call.function.arguments, "tool_calls")


def test_auto_with_two_calls_gives_both_or_only_the_first_without_parallel_calls(http_server) -> None:
    client = sdk(http_server)
    lima = '{"name": "get_weather", "arguments": {"city": "Lima", "unit": "fahrenheit"}}'
    reply = f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{lima}\n</tool_call>"
    both = _create(client, messages=_scripted(reply), tools=TOOLS, tool_choice="auto").choices[0]
    assert both.finish_reason == "tool_calls" and both.message.content is None
    assert [json.loads(c.function.arguments)["city"] for c in both.message.tool_calls] == ["Paris", "Lima"]
    first = _create(client, messages=_scripted(reply), tools=TOOLS, parallel_tool_calls=False).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    assert [json.loads(c.function.arguments)["city"] for c in first.message.tool_calls] == ["Paris"]


@pytest.mark.parametrize(
    "reply",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',  # bad JSON
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # not one of the tools
        '<tool_call>\n{"name": "get_weather", "arguments": ["Paris"]}\n</tool_call>',  # arguments not an object
    ],
    ids=["bad-json", "unknown-function", "list-arguments"],
)
def test_auto_returns_malformed_markup_as_plain_text(http_server, reply: str) -> None:
    client = sdk(http_server)
    choice = _create(client, messages=_scripted(reply), tools=TOOLS, tool_choice="auto").choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content == reply  # as written, tags included: never a broken call
    assert choice.finish_reason == "stop"


def test_none_never_calls_returns_markup_as_text_and_hides_the_tools(http_server) -> None:
    client = sdk(http_server)
    reply = f"<tool_call>\n{PARIS}\n</tool_call>"
    auto = _create(client, messages=_scripted(reply), tools=TOOLS, tool_choice="auto")
    assert auto.choices[0].message.tool_calls  # the same reply is a call under auto...
    none = _create(client, messages=_scripted(reply), tools=TOOLS, tool_choice="none")
    choice = none.choices[0]
    assert choice.message.tool_calls is None  # ...and text under none
    assert choice.message.content == reply and choice.finish_reason == "stop"
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens  # the tools are not shown to the model


def test_grpc_clients_get_calls_from_the_same_prompt_and_refusals_name_the_field(http_server) -> None:
    from kvserve.clients import Client, KVServeError

    weather = {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}
    with Client(f"127.0.0.1:{http_server.port}") as client:
        done = client.generate(
            messages=USER,
            tools=[weather],
            tool_choice={"function": "get_weather"},
            parallel_tool_calls=False,
            max_tokens=1000,
            temperature=0,
        )
        assert done.finish_reason == "tool_calls" and done.text == ""
        _validate([_Call(c) for c in done.tool_calls])
        with pytest.raises(KVServeError) as info:
            client.generate(messages=USER, tools=[weather], tool_choice={"function": "nope"}, max_tokens=5)
        assert "chat.tool_choice.function" in str(info.value)
    http = _create(
        sdk(http_server),
        tools=TOOLS[:1],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        temperature=0,
    )
    assert http.usage.prompt_tokens == done.usage.prompt_tokens  # the same prompt: tools rendered alike
    assert http.usage.completion_tokens == done.usage.completion_tokens


def test_cli_generate_with_a_tool_file_prints_the_call(http_server, tmp_path) -> None:
    import subprocess

    tool = tmp_path / "weather.json"
    tool.write_text(json.dumps(TOOLS[0]))
    args = [
        "generate",
        "Weather in Paris?",
        "--tool",
        str(tool),
        "--tool-choice",
        "get_weather",
        "--max-tokens",
        "1000",
    ]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve",
            *args,
            "--no-parallel-tool-calls",
            "--host",
            "127.0.0.1",
            "--port",
            str(http_server.port),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    call = json.loads(result.stdout.strip().splitlines()[-1])["tool_call"]
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)


class _Call:
    """The SDK's call shape over a gRPC client's ToolCall, for `_validate`."""

    def __init__(self, call) -> None:
        self.id, self.type = call.id, "function"
        self.function = type("F", (), {"name": call.name, "arguments": call.arguments})()
