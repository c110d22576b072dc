"""Structured output on the real default model (SmolLM2, CPU fp32), through the real processes.

The OpenAI SDK asks for a JSON schema, any JSON object, an ISO date and a choice; every
answer must parse, validate and match. Greedy constrained output must be the same on a
second run and across a kill -9 of the executor mid-stream (the matchers live in the
scheduler, which survives it), and n=4 seeded samples must all be valid.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal

import jsonschema
import pytest
from grpc_health.v1 import health_pb2

from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.testing.server_launcher import ServeProcess
from tests.services.person_requests import PEOPLE, PERSON, ask_all, person_prompt
from tests.shared_servers import REAL_MODEL_ARGS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

QUESTIONS = [
    "What is the capital of France?", "How many legs does a spider have?", "What color is the sky?",
    "Who wrote Hamlet?", "What is 7 times 6?", "What is the largest ocean?", "What gas do plants absorb?",
    "What is the boiling point of water?", "Which planet is closest to the sun?",
    "What language is spoken in Brazil?", "How many days are in a week?", "What is the opposite of hot?",
]  # fmt: skip
ISO_DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
SENTIMENTS = ["positive", "negative", "neutral"]
SERVE_ARGS = REAL_MODEL_ARGS


@pytest.fixture
def real_server(real_model_server: ServeProcess) -> ServeProcess:
    """The session's shared real-model server (tests/conftest.py), which serves `SERVE_ARGS`."""
    return real_model_server


def test_twelve_prompts_under_a_json_schema_all_validate(real_server) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    responses = ask_all(
        real_server,
        [dict(messages=person_prompt(p), max_tokens=200, temperature=0, response_format=fmt) for p in PEOPLE],
    )
    for who, response in zip(PEOPLE, responses, strict=True):
        text = response.choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)
        assert response.choices[0].finish_reason == "stop", (who, text)


def test_twelve_prompts_under_json_object_all_parse(real_server) -> None:
    responses = ask_all(
        real_server,
        [
            dict(
                messages=[{"role": "user", "content": f'{q} Reply with a JSON object with the single key "answer".'}],
                max_tokens=192,
                temperature=0,
                response_format={"type": "json_object"},
            )
            for q in QUESTIONS
        ],
    )
    for question, response in zip(QUESTIONS, responses, strict=True):
        text = response.choices[0].message.content
        assert isinstance(json.loads(text), dict), (question, text)


def test_an_iso_date_regex_matches_in_full_and_choice_picks_a_choice(real_server) -> None:
    date_questions = ["On what date did World War II end in Europe?", "When was the first Moon landing?"]
    reviews = ["I loved this film!", "Terrible service, never again.", "It was fine, I guess.", "Best pizza ever."]
    responses = ask_all(
        real_server,
        [
            dict(
                messages=[{"role": "user", "content": q}],
                max_tokens=20,
                temperature=0,
                extra_body={"structured_outputs": {"regex": ISO_DATE}},
            )
            for q in date_questions
        ]
        + [
            dict(
                messages=[{"role": "user", "content": f"Is this review positive, negative or neutral? {r}"}],
                max_tokens=10,
                temperature=0.7,
                seed=i,
                extra_body={"structured_outputs": {"choice": SENTIMENTS}},
            )
            for i, r in enumerate(reviews)
        ],
    )
    for response in responses[: len(date_questions)]:
        assert re.fullmatch(ISO_DATE, response.choices[0].message.content)
        assert response.choices[0].finish_reason == "stop"
    for response in responses[len(date_questions) :]:
        assert response.choices[0].message.content in SENTIMENTS


def test_four_seeded_samples_are_all_valid(real_server) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    (response,) = ask_all(
        real_server,
        [
            dict(
                messages=person_prompt("a lighthouse keeper"),
                max_tokens=200,
                n=4,
                seed=11,
                temperature=0.8,
                response_format=fmt,
            )
        ],
    )
    assert len(response.choices) == 4
    for choice in response.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def _grpc_request(who: str) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(
        chat=api_pb2.ChatPrompt(messages=[api_pb2.ChatMessage(**m) for m in person_prompt(who)]),
        sampling=api_pb2.SamplingParams(temperature=0.0, max_tokens=200),
        structured=api_pb2.StructuredOutput(json_schema=json.dumps(PERSON)),
    )


def test_greedy_constrained_output_is_identical_across_runs_and_a_kill_9(serve_factory) -> None:
    server = serve_factory(SERVE_ARGS)
    who = PEOPLE[:4]

    async def run(kill: bool) -> list[str]:
        async with server.aio_channel() as channel:
            stub = api_pb2_grpc.KVServeStub(channel)
            first_chunk = [asyncio.Event() for _ in who]

            async def one(i: int) -> str:
                text = ""
                async for chunk in stub.Generate(_grpc_request(who[i]), timeout=600):
                    text += chunk.text
                    first_chunk[i].set()
                return text

            tasks = [asyncio.create_task(one(i)) for i in range(len(who))]
            if kill:
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_chunk)), timeout=300)
                os.kill(server.executor_pids()[-1], signal.SIGKILL)  # every stream is mid-way
            return await asyncio.gather(*tasks)

    first = asyncio.run(run(kill=False))
    second = asyncio.run(run(kill=False))
    disturbed = asyncio.run(run(kill=True))
    assert second == first
    assert disturbed == first
    for text in first:
        jsonschema.validate(json.loads(text), PERSON)
    stats = server.wait_idle(timeout_s=60)
    assert stats.executor_restarts == 1 and stats.blocks_referenced == 0
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
