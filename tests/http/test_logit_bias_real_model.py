"""`logit_bias` on the real default model through the `openai` SDK: -100 moves the greedy answer off its
first token, +100 forces a token, and a structured-output grammar still wins over +100."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from kvserve.testing.server_launcher import ServeProcess
from tests.http.http_clients import sdk

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = "The capital of Japan is"
ANSWER = {
    "type": "object",
    # Bounded: the default model's native weights (greedy and seeded) repeat digits without end otherwise.
    "properties": {"population_millions": {"type": "integer", "minimum": 0, "maximum": 1000}},
    "required": ["population_millions"],
    "additionalProperties": False,
}


def _token_id(server: ServeProcess, text: str) -> int:
    """The one token id `text` encodes to."""
    response = httpx.post(f"{server.http_url}/tokenize", json={"prompt": text}, timeout=30).json()
    (token,) = response["tokens"]
    return token


def _complete(server: ServeProcess, **kwargs) -> str:
    client = sdk(server)
    model = client.models.list().data[0].id
    return client.completions.create(model=model, prompt=PROMPT, **kwargs).choices[0].text


def test_minus_100_on_the_greedy_first_token_changes_it(real_model_server: ServeProcess) -> None:
    first = _complete(real_model_server, max_tokens=1, temperature=0)
    banned = _token_id(real_model_server, first)
    again = _complete(real_model_server, max_tokens=1, temperature=0, logit_bias={str(banned): -100})
    assert again != first and _token_id(real_model_server, again) != banned, (first, again)
    sampled = [
        _complete(real_model_server, max_tokens=1, temperature=1.5, seed=seed, logit_bias={str(banned): -100})
        for seed in range(4)
    ]
    assert first not in sampled, sampled


def test_plus_100_forces_a_token(real_model_server: ServeProcess) -> None:
    paris = _token_id(real_model_server, " Paris")
    assert _complete(real_model_server, max_tokens=3, temperature=0, logit_bias={str(paris): 100}) == " Paris" * 3
    sampled = _complete(real_model_server, max_tokens=3, temperature=1.0, seed=3, logit_bias={str(paris): 100})
    assert sampled == " Paris" * 3


def test_a_json_schema_wins_over_plus_100_on_a_token_it_forbids(real_model_server: ServeProcess) -> None:
    client = sdk(real_model_server)
    model = client.models.list().data[0].id
    forbidden = {str(_token_id(real_model_server, word)): 100 for word in (" Paris", " the", " people")}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    messages = [{"role": "user", "content": "How many million people live in Tokyo? Answer in JSON."}]
    for temperature in (0.0, 1.0):
        choice = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=40,
            temperature=temperature,
            seed=1,
            response_format=fmt,
            logit_bias=forbidden,
        ).choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), ANSWER)
