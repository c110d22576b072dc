"""Request building and response conversion, without a server."""

from __future__ import annotations

import json

import grpc
import pytest

import kvserve.clients
from kvserve.clients.errors import KVServeError
from kvserve.clients.request_builder import (
    CompletionAssembler,
    build_generate_request,
    chunk_from_response,
    message_to_dict,
)
from kvserve.config import defaults
from kvserve.protos.kvserve.v1 import api_pb2


def test_default_target_matches_common_defaults() -> None:
    assert kvserve.clients.DEFAULT_HOST == defaults.GRPC_HOST
    assert kvserve.clients.DEFAULT_PORT == defaults.GRPC_PORT
    assert f"{defaults.GRPC_HOST}:{defaults.GRPC_PORT}" == kvserve.clients.DEFAULT_TARGET


def test_sampling_kwargs_fill_only_given_fields() -> None:
    request = build_generate_request(
        "hi",
        temperature=0.0,
        top_k=5,
        stop=["\n", "END"],
        stop_token_ids=[7],
        ignore_eos=True,
        seed=3,
        max_tokens=None,
        request_id="r1",
        priority=2,
        cache_salt="s",
    )
    assert request.text == "hi"
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    assert request.sampling.top_k == 5
    assert list(request.sampling.stop) == ["\n", "END"]
    assert list(request.sampling.stop_token_ids) == [7]
    assert request.sampling.ignore_eos is True
    assert not request.sampling.HasField("max_tokens")  # None leaves the server default
    assert not request.sampling.HasField("top_p")
    assert (request.request_id, request.priority, request.cache_salt) == ("r1", 2, "s")


def test_single_stop_string_is_not_split_into_characters() -> None:
    assert list(build_generate_request("x", stop="END").sampling.stop) == ["END"]


def test_logit_bias_is_a_map_of_token_ids() -> None:
    assert dict(build_generate_request("x", logit_bias={5: -100, 7: 2.5}).sampling.logit_bias) == {5: -100.0, 7: 2.5}


def test_unknown_sampling_kwarg_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="temprature"):
        build_generate_request("x", temprature=0.5)


@pytest.mark.parametrize("kwargs", [{}, {"prompt": "a", "token_ids": [1]}, {"token_ids": [1], "messages": []}])
def test_exactly_one_prompt_form(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        build_generate_request(**kwargs)


def test_token_ids_and_messages_prompts() -> None:
    assert list(build_generate_request(token_ids=[5, 6]).token_ids.ids) == [5, 6]
    chat = build_generate_request(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ).chat
    assert [(m.role, m.content) for m in chat.messages] == [("system", "be brief"), ("user", "hi")]


def test_chunk_conversion_with_usage_and_logprobs() -> None:
    response = api_pb2.GenerateResponse(
        request_id="r",
        index=1,
        token_ids=[9, 10],
        text="ab",
        logprobs=[
            api_pb2.TokenLogprobs(token_id=9, logprob=-0.25, top=[api_pb2.Logprob(token_id=3, logprob=-1.5)]),
            api_pb2.TokenLogprobs(token_id=10, logprob=-0.75),
        ],
        finish_reason=api_pb2.FINISH_REASON_EOS,
        usage=api_pb2.Usage(
            prompt_tokens=5, completion_tokens=2, cached_tokens=4, queue_time_s=0.5, ttft_s=0.75, e2e_s=1.5
        ),
    )
    chunk = chunk_from_response(response)
    assert (chunk.request_id, chunk.index, chunk.token_ids, chunk.text) == ("r", 1, [9, 10], "ab")
    assert chunk.finish_reason == "eos"
    assert chunk.logprobs[0].token_id == 9 and chunk.logprobs[0].top == [(3, -1.5)]
    assert chunk.logprobs[1].logprob == -0.75 and chunk.logprobs[1].top == []
    assert chunk.usage == kvserve.clients.Usage(5, 2, 4, 0.5, 0.75, 1.5)


def test_running_chunk_has_no_finish_reason_or_usage() -> None:
    chunk = chunk_from_response(api_pb2.GenerateResponse(request_id="r", token_ids=[1], text="a"))
    assert chunk.finish_reason is None and chunk.usage is None


@pytest.mark.parametrize(
    "value,name",
    [
        (api_pb2.FINISH_REASON_STOP, "stop"),
        (api_pb2.FINISH_REASON_LENGTH, "length"),
        (api_pb2.FINISH_REASON_ABORT, "abort"),
        (api_pb2.FINISH_REASON_ERROR, "error"),
    ],
)
def test_finish_reason_names(value: int, name: str) -> None:
    response = api_pb2.GenerateResponse(finish_reason=value)
    assert chunk_from_response(response).finish_reason == name


def test_assembler_orders_choices_and_mirrors_index_zero() -> None:
    assembler = CompletionAssembler(n=2)
    usage = kvserve.clients.Usage(1, 2, 0, 0.0, 0.0, 0.0)
    for chunk in [
        kvserve.clients.Chunk("r", 1, [20], "x"),
        kvserve.clients.Chunk("r", 0, [10], "a"),
        kvserve.clients.Chunk("r", 0, [11], "b", finish_reason="stop", usage=usage),
        kvserve.clients.Chunk("r", 1, [21], "y", finish_reason="length", usage=usage),
    ]:
        assembler.add(chunk)
    completion = assembler.result()
    assert [c.text for c in completion.choices] == ["ab", "xy"]
    assert [c.token_ids for c in completion.choices] == [[10, 11], [20, 21]]
    assert (completion.text, completion.finish_reason, completion.request_id) == ("ab", "stop", "r")
    assert completion.choices[1].finish_reason == "length"


def test_assembler_rejects_unfinished_stream() -> None:
    assembler = CompletionAssembler(n=2)
    assembler.add(kvserve.clients.Chunk("r", 0, [1], "a", finish_reason="stop"))
    with pytest.raises(KVServeError) as info:
        assembler.result()
    assert "completion 1" in info.value.details


def test_message_to_dict_names_enums() -> None:
    stats = message_to_dict(api_pb2.ServerStatsResponse(num_blocks=8, executor_state=api_pb2.EXECUTOR_STATE_LOST))
    assert stats["num_blocks"] == 8 and stats["executor_state"] == "LOST"
    info = message_to_dict(api_pb2.ModelInfoResponse(model_id="m", eos_token_ids=[1, 2]))
    assert info["model_id"] == "m" and info["eos_token_ids"] == [1, 2]


def test_error_carries_code_and_details() -> None:
    error = KVServeError(grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p: must be in (0, 1]")
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert str(error) == "INVALID_ARGUMENT: sampling.top_p: must be in (0, 1]"


def test_clients_import_no_kvserve_internals() -> None:
    import ast
    from pathlib import Path

    allowed = ("grpc", "grpc_health", "kvserve.protos.kvserve.v1", "kvserve.clients", "__future__")
    for path in Path(kvserve.clients.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                top = name.split(".")[0]
                stdlib = top in __import__("sys").stdlib_module_names
                assert stdlib or name.startswith(allowed), f"{path.name} imports {name}"


def test_structured_constraints_become_the_proto_oneof() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = build_generate_request("p", structured={"json_schema": schema})
    assert request.structured.WhichOneof("kind") == "json_schema"
    assert json.loads(request.structured.json_schema) == schema
    choice = build_generate_request("p", structured={"choice": ("yes", "no")}).structured
    assert list(choice.choice.choices) == ["yes", "no"]
    assert build_generate_request("p", structured={"json_object": True}).structured.json_object
    assert not build_generate_request("p").HasField("structured")
    for bad in ({}, {"regex": "a", "choice": ["b"]}, {"xml": "<a/>"}):
        with pytest.raises(ValueError, match="exactly one of json_schema"):
            build_generate_request("p", structured=bad)


def test_model_names_a_lora_adapter_and_defaults_to_the_base_model() -> None:
    assert build_generate_request("hi", model="alpha").model == "alpha"
    assert build_generate_request("hi").model == ""
    assert "model" not in {f.name for f in api_pb2.SamplingParams.DESCRIPTOR.fields}, "not a sampling keyword"
