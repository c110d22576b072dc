"""The OpenAI body parser and the gRPC → OpenAI field-name table, without a server."""

from __future__ import annotations

import pytest

from kvserve.protos.kvserve.v1 import api_pb2
from kvserve.scheduler.server.http.errors import ApiError
from kvserve.scheduler.server.http.field_names import GRPC_TO_OPENAI, ParamNames, capacity_param, openai_param
from kvserve.scheduler.server.http.openai_request import parse_chat_body, parse_completion_body

USER = [{"role": "user", "content": "hi"}]


def refusal(parse, body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value


def test_every_sampling_field_of_the_proto_has_an_openai_name() -> None:
    for name in api_pb2.SamplingParams.DESCRIPTOR.fields_by_name:
        assert f"sampling.{name}" in GRPC_TO_OPENAI, name


@pytest.mark.parametrize(
    "grpc_field, names, expected",
    [
        ("sampling.top_p", ParamNames(), "top_p"),
        ("chat.messages[0].role", ParamNames(prompt="messages"), "messages[0].role"),
        ("chat.messages", ParamNames(prompt="messages"), "messages"),
        ("chat", ParamNames(prompt="messages"), "messages"),
        ("token_ids", ParamNames(), "prompt"),
        ("text", ParamNames(prompt="prompt[2]"), "prompt[2]"),
        ("sampling.max_tokens", ParamNames(max_tokens="max_completion_tokens"), "max_completion_tokens"),
        ("sampling.logprobs", ParamNames(logprobs="top_logprobs"), "top_logprobs"),
        ("sampling.logprobs", ParamNames(), "logprobs"),
        ("priority", ParamNames(), "priority"),
    ],
)
def test_grpc_field_paths_map_to_openai_params(grpc_field: str, names: ParamNames, expected: str) -> None:
    assert openai_param(grpc_field, names) == expected


def test_capacity_refusals_name_the_openai_field() -> None:
    assert capacity_param("max_tokens", ParamNames(max_tokens="max_completion_tokens")) == "max_completion_tokens"
    assert capacity_param("prompt", ParamNames(prompt="messages")) == "messages"


def test_chat_body_becomes_one_generate_request() -> None:
    parsed = parse_chat_body(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "max_completion_tokens": 7,
            "temperature": 0,
            "top_k": 0,
            "n": 2.0,
            "stop": "END",
            "seed": 5,
            "logprobs": True,
            "top_logprobs": 3,
            "priority": -2,
            "cache_salt": "s",
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "u1",
            "surprise": 1,
        }
    )
    (prompt,) = parsed.prompts
    request = prompt.request
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "be brief"), ("user", "a\nb")]
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.n, list(s.stop), s.seed, s.logprobs) == (7, 0, -1, 2, ["END"], 5, 3)
    assert (request.priority, request.cache_salt) == (-2, "s")
    assert parsed.stream and parsed.include_usage and parsed.logprobs and parsed.n == 2
    assert prompt.names.max_tokens == "max_completion_tokens" and prompt.names.logprobs == "top_logprobs"
    assert parsed.user == "u1" and parsed.model == "m"
    assert parsed.unknown == ("surprise",)


def test_null_fields_count_as_absent() -> None:
    parsed = parse_chat_body({"messages": USER, "temperature": None, "tools": None, "stop": None, "n": None})
    assert not parsed.prompts[0].request.sampling.HasField("temperature")
    assert parsed.n == 1 and parsed.unknown == ()


@pytest.mark.parametrize(
    "prompt, shapes",
    [
        ("one", [("text", "one")]),
        (["a", "b"], [("text", "a"), ("text", "b")]),
        ([1, 2, 3], [("token_ids", [1, 2, 3])]),
        ([[1, 2], [3]], [("token_ids", [1, 2]), ("token_ids", [3])]),
    ],
)
def test_completion_prompt_shapes(prompt, shapes) -> None:
    parsed = parse_completion_body({"prompt": prompt, "n": 2})
    got = []
    for p in parsed.prompts:
        kind = p.request.WhichOneof("prompt")
        got.append((kind, p.request.text if kind == "text" else list(p.request.token_ids.ids)))
        assert p.request.sampling.n == 2
    assert got == shapes
    if len(shapes) > 1:
        assert [p.names.prompt for p in parsed.prompts] == [f"prompt[{i}]" for i in range(len(shapes))]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": USER, "temperature": "hot"}, "temperature"),
        ({"messages": USER, "n": True}, "n"),
        ({"messages": USER, "n": 1.5}, "n"),
        ({"messages": USER, "seed": 2**70}, "seed"),
        ({"messages": USER, "stop": ["ok", 3]}, "stop[1]"),
        ({"messages": USER, "stream": "yes"}, "stream"),
        ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": USER, "max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
        ({"messages": "hi"}, "messages"),
        ({}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": USER, "response_format": {"type": "xml"}}, "response_format.type"),
        ({"messages": USER, "tools": [{"type": "function"}]}, "tools[0].function"),
        ({"messages": USER, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"messages": USER, "tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name"),
        ({"messages": USER, "tools": [{"function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters"),
        ({"messages": USER, "tools": {"name": "f"}}, "tools"),
        ({"messages": USER, "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": USER, "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
        ({"messages": USER, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"messages": USER, "functions": [{"name": "f"}]}, "functions"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": 1}}]}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"messages": USER, "logit_bias": {"one": 5}}, "logit_bias"),
    ],
)
def test_chat_refusals_name_the_openai_field(body: dict, param: str) -> None:
    assert refusal(parse_chat_body, body).param == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", 1]}, "prompt"),
        ({"prompt": [[1], ["x"]]}, "prompt[1][0]"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": ["p"] * 65}, "prompt"),
        ({"prompt": "p", "suffix": "s"}, "suffix"),
        ({"prompt": "p", "best_of": 3}, "best_of"),
        ({"prompt": "p", "echo": True, "logprobs": 1}, "echo"),
        ({"prompt": "p", "logit_bias": {"1": "5"}}, "logit_bias"),
    ],
)
def test_completion_refusals_name_the_openai_field(body: dict, param: str) -> None:
    assert refusal(parse_completion_body, body).param == param


def test_accepted_no_op_values_of_refused_fields() -> None:
    parse_chat_body({"messages": USER, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none"})
    parse_completion_body({"prompt": "p", "best_of": 1, "suffix": ""})
