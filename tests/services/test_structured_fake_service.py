"""Structured output through `kvserve serve --executor fake` over gRPC, with the generated stubs.

The fake executor samples only among the tokens each step's mask allows, so a choice or a
fixed-string regex comes out whole, and a schema of enums comes out valid: what is
checked is that the scheduler compiles the spec, masks each step and ends at the grammar's
end, over the real processes and sockets.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import grpc
import jsonschema
import pytest
from grpc_health.v1 import health_pb2

from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc

pytestmark = pytest.mark.timeout(300)

CHOICES = ["positive", "negative", "somewhat neutral, maybe"]
ENUM_SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "light blue"]},
        "size": {"enum": ["S", "M", "L"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["color", "size", "tags"],
    "additionalProperties": False,
}


def _request(structured: api_pb2.StructuredOutput, *, prompt: str = "Say something.", **sampling):
    sampling.setdefault("max_tokens", 64)
    sampling.setdefault("temperature", 0.0)
    return api_pb2.GenerateRequest(text=prompt, sampling=api_pb2.SamplingParams(**sampling), structured=structured)


async def _texts(server, request: api_pb2.GenerateRequest) -> dict[int, tuple[str, int]]:
    """index -> (text, finish reason)."""
    texts: dict[int, str] = {}
    reasons: dict[int, int] = {}
    async with server.aio_channel() as channel:
        async for chunk in api_pb2_grpc.KVServeStub(channel).Generate(request, timeout=60):
            texts[chunk.index] = texts.get(chunk.index, "") + chunk.text
            reasons[chunk.index] = chunk.finish_reason or reasons.get(chunk.index, 0)
    return {i: (texts[i], reasons[i]) for i in texts}


def _one(server, request) -> tuple[str, int]:
    return asyncio.run(_texts(server, request))[0]


def test_choice_gives_one_of_the_choices_and_ends_with_stop(fake_server) -> None:
    structured = api_pb2.StructuredOutput(choice=api_pb2.ChoiceList(choices=CHOICES))
    seen = set()
    for i in range(6):
        text, reason = _one(fake_server, _request(structured, prompt=f"Review {i}:", temperature=1.0, seed=i))
        assert text in CHOICES and reason == api_pb2.FINISH_REASON_STOP
        seen.add(text)
    assert len(seen) > 1, "the choice must not depend on the first token alone"


def test_regex_of_fixed_strings_matches_in_full(fake_server) -> None:
    pattern = r"(alpha|beta) (one|two|three)!"
    structured = api_pb2.StructuredOutput(regex=pattern)
    for i in range(4):
        text, reason = _one(fake_server, _request(structured, prompt=f"Name {i}", temperature=1.0, seed=10 + i))
        assert re.fullmatch(pattern, text), text
        assert reason == api_pb2.FINISH_REASON_STOP


def test_a_schema_of_enums_gives_valid_json_for_each_of_n_seeded_completions(fake_server) -> None:
    structured = api_pb2.StructuredOutput(json_schema=json.dumps(ENUM_SCHEMA))
    completions = asyncio.run(_texts(fake_server, _request(structured, n=4, seed=5, temperature=1.0, max_tokens=96)))
    assert sorted(completions) == [0, 1, 2, 3]
    for text, reason in completions.values():
        jsonschema.validate(json.loads(text), ENUM_SCHEMA)
        assert reason == api_pb2.FINISH_REASON_STOP


@pytest.mark.parametrize(
    ("structured", "field", "message"),
    [
        (api_pb2.StructuredOutput(json_schema='{"type": "object",'), "structured.json_schema", "not valid JSON"),
        (
            api_pb2.StructuredOutput(json_schema='{"type": "object", "propertyNames": {"pattern": "^a"}}'),
            "structured.json_schema",
            "propertyNames",
        ),
        (api_pb2.StructuredOutput(regex="[0-9"), "structured.regex", "regex"),
        (api_pb2.StructuredOutput(choice=api_pb2.ChoiceList()), "structured.choice", "at least one"),
    ],
    ids=["invalid-json", "unsupported-keyword", "invalid-regex", "no-choices"],
)
def test_bad_specs_are_refused_before_any_token_and_the_server_stays_healthy(
    fake_server, structured, field: str, message: str
) -> None:
    chunks = []
    with fake_server.channel() as channel, pytest.raises(grpc.RpcError) as caught:
        for chunk in api_pb2_grpc.KVServeStub(channel).Generate(_request(structured), timeout=30):
            chunks.append(chunk)
    assert chunks == []
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}: ") and message in caught.value.details()
    assert fake_server.health() == health_pb2.HealthCheckResponse.SERVING
    good = api_pb2.StructuredOutput(choice=api_pb2.ChoiceList(choices=["ok"]))
    assert _one(fake_server, _request(good)) == ("ok", api_pb2.FINISH_REASON_STOP)
    stats = fake_server.wait_idle()
    assert stats.blocks_referenced == 0 and stats.requests_waiting == 0
    assert "Traceback" not in fake_server.log_text()


def test_readme_grpc_structured_example_runs(fake_server, capsys: pytest.CaptureFixture) -> None:
    readme = Path(__file__).resolve().parents[2] / "README.md"
    (source,) = [b for b in re.findall(r"```python\n(.*?)```", readme.read_text(), re.S) if "structured=" in b]
    assert "127.0.0.1:50051" in source
    exec(compile(source.replace("127.0.0.1:50051", fake_server.address), "README-grpc-structured", "exec"), {})
    assert capsys.readouterr().out.strip() in ("yes", "no")
