"""`logit_bias` against `kvserve serve --executor fake`: refusals over HTTP (the `openai` SDK) and gRPC
(the generated stubs) name the field, and the fake executor honours what passes (+bias forces, -100 bans).
"""

from __future__ import annotations

import math

import grpc
import httpx
import openai
import pytest

from kvserve.config import defaults
from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.testing.server_launcher import ServeProcess
from tests.http.http_clients import sdk

MODEL = "fake:smollm2-135m-instruct"
USER = [{"role": "user", "content": "Name a city."}]
LIMIT = defaults.MAX_LOGIT_BIAS_ENTRIES


@pytest.fixture
def vocab_size(http_server: ServeProcess) -> int:
    with http_server.channel() as channel:
        return api_pb2_grpc.KVServeStub(channel).ModelInfo(api_pb2.ModelInfoRequest(), timeout=10).vocab_size


def _bad_biases(vocab: int) -> list[tuple[str, dict]]:
    return [
        ("word key", {"abc": 1}),
        ("fractional key", {"1.5": 1}),
        ("padded key", {" 7": 1}),
        ("id past the vocabulary", {str(vocab): 1}),
        ("negative id", {"-1": 1}),
        ("id past int64", {"9" * 25: 1}),
        ("bias over 100", {"7": 100.5}),
        ("bias under -100", {"7": -101}),
        ("string bias", {"7": "5"}),
        ("null bias", {"7": None}),
        ("boolean bias", {"7": True}),
        ("huge bias", {"7": 10**400}),
        ("too many entries", {str(i): 1 for i in range(LIMIT + 1)}),
        ("not an object", [[7, 1]]),
    ]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_each_bad_logit_bias_is_a_400_naming_the_field(http_server: ServeProcess, vocab_size: int, endpoint) -> None:
    client = sdk(http_server)
    for case, bias in _bad_biases(vocab_size):
        with pytest.raises(openai.BadRequestError) as info:
            if endpoint == "chat":
                client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, logit_bias=bias)
            else:
                client.completions.create(model=MODEL, prompt="Name a city.", max_tokens=3, logit_bias=bias)
        error = info.value.body
        assert info.value.status_code == 400, case
        assert error["param"] == "logit_bias" and error["message"].startswith("logit_bias: "), (case, error)
    assert http_server.wait_idle().requests_running == 0  # nothing refused reached the engine or stayed in it
    ok = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    assert ok.choices[0].finish_reason == "length"


def test_the_limits_themselves_are_accepted(http_server: ServeProcess, vocab_size: int) -> None:
    client = sdk(http_server)
    bias = {str(t): (-100 if t % 2 else 100) for t in range(vocab_size - LIMIT, vocab_size)}  # the last id too
    bias[str(vocab_size - LIMIT)] = 0.5  # fractional biases are fine
    done = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, logit_bias=bias)
    assert done.choices[0].finish_reason == "length"
    empty = client.completions.create(model=MODEL, prompt="Name a city.", max_tokens=3, logit_bias={})
    assert empty.choices[0].finish_reason == "length"


def test_a_positive_bias_forces_its_token_over_http(http_server: ServeProcess) -> None:
    tokenized = httpx.post(f"{http_server.http_url}/tokenize", json={"prompt": " Paris"}, timeout=30).json()
    (paris,) = tokenized["tokens"]
    client = sdk(http_server)
    for temperature in (0.0, 1.0):
        text = client.completions.create(
            model=MODEL, prompt="Name a city.", max_tokens=4, temperature=temperature, logit_bias={str(paris): 3}
        ).choices[0]
        assert text.text == " Paris" * 4, temperature


def _generate(server: ServeProcess, sampling: api_pb2.SamplingParams, **kwargs) -> list[int]:
    request = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=[100, 200, 300]), sampling=sampling, **kwargs)
    with server.channel() as channel:
        return [t for chunk in api_pb2_grpc.KVServeStub(channel).Generate(request, timeout=30) for t in chunk.token_ids]


def test_over_grpc_minus_100_bans_and_the_highest_bias_wins(http_server: ServeProcess) -> None:
    greedy = api_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = _generate(http_server, greedy)
    greedy.logit_bias.update(dict.fromkeys(plain, -100.0))
    assert not set(_generate(http_server, greedy)) & set(plain)
    forced = api_pb2.SamplingParams(
        temperature=0.7, seed=5, max_tokens=5, ignore_eos=True, logit_bias={500: 40, 900: 90, 901: 90, 902: -100}
    )
    assert _generate(http_server, forced) == [900] * 5  # highest bias, lowest id on a tie


def test_over_grpc_the_grammar_wins_over_a_positive_bias(http_server: ServeProcess) -> None:
    structured = api_pb2.StructuredOutput(choice=api_pb2.ChoiceList(choices=["yes", "no"]))
    sampling = api_pb2.SamplingParams(temperature=0.0, max_tokens=8, logit_bias={900: 100})
    request = api_pb2.GenerateRequest(text="Answer:", sampling=sampling, structured=structured)
    with http_server.channel() as channel:
        chunks = list(api_pb2_grpc.KVServeStub(channel).Generate(request, timeout=30))
    assert "".join(c.text for c in chunks) in ("yes", "no")
    assert 900 not in [t for c in chunks for t in c.token_ids]


def test_grpc_refuses_bad_logit_bias_with_invalid_argument(http_server: ServeProcess, vocab_size: int) -> None:
    cases = {
        "id past the vocabulary": {vocab_size: 1.0},
        "negative id": {-3: 1.0},
        "bias over 100": {7: 100.01},
        "bias under -100": {7: -250.0},
        "nan bias": {7: math.nan},
        "infinite bias": {7: math.inf},
        "too many entries": dict.fromkeys(range(LIMIT + 1), 1.0),
    }
    with http_server.channel() as channel:
        stub = api_pb2_grpc.KVServeStub(channel)
        for case, bias in cases.items():
            request = api_pb2.GenerateRequest(text="hi", sampling=api_pb2.SamplingParams(logit_bias=bias))
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=10))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
            assert info.value.details().startswith("sampling.logit_bias: "), (case, info.value.details())
    assert http_server.wait_idle().requests_running == 0
