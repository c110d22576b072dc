"""Structured-output specs: shape checks, the llguidance backend's refusals, and the compile cache."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from kvserve.config import defaults
from kvserve.executor.fake.vocabulary import default_model_dir
from kvserve.protos.kvserve.v1 import api_pb2
from kvserve.protos.sampling import InvalidFieldError
from kvserve.scheduler.server.intake.tokenizer import Tokenizer
from kvserve.scheduler.server.structured.compiler import GrammarCompiler
from kvserve.scheduler.server.structured.llguidance_backend import LlguidanceBackend
from kvserve.scheduler.server.structured.spec import StructuredSpec, structured_spec


def _spec(**kind) -> StructuredSpec | None:
    return structured_spec(api_pb2.GenerateRequest(text="x", structured=api_pb2.StructuredOutput(**kind)))


def test_each_kind_parses_and_keeps_the_schema_key_order() -> None:
    assert structured_spec(api_pb2.GenerateRequest(text="x")) is None
    schema = _spec(json_schema='{"properties": {"z": {}, "a": {}},   "type": "object"}')
    assert schema == StructuredSpec("json_schema", "structured.json_schema", text=schema.text)
    assert list(json.loads(schema.text)["properties"]) == ["z", "a"]
    assert _spec(json_object=True) == StructuredSpec("json_object", "structured.json_object")
    assert _spec(regex="[0-9]+").text == "[0-9]+"
    assert _spec(choice=api_pb2.ChoiceList(choices=["a", "b", "a"])).choices == ("a", "b")
    assert _spec(grammar='start: "x"').kind == "grammar"


@pytest.mark.parametrize(
    ("kind", "field", "message"),
    [
        ({}, "structured", "set one of"),
        ({"json_schema": "{not json"}, "structured.json_schema", "not valid JSON"),
        ({"json_schema": "[1, 2]"}, "structured.json_schema", "JSON object"),
        ({"json_object": False}, "structured.json_object", "true"),
        ({"regex": ""}, "structured.regex", "must not be empty"),
        ({"grammar": ""}, "structured.grammar", "must not be empty"),
        ({"choice": api_pb2.ChoiceList()}, "structured.choice", "at least one"),
        ({"choice": api_pb2.ChoiceList(choices=["a", ""])}, "structured.choice", "empty"),
        ({"regex": "a" * (defaults.MAX_STRUCTURED_SPEC_CHARS + 1)}, "structured.regex", "at most"),
    ],
)
def test_bad_shapes_are_refused_naming_the_field(kind: dict, field: str, message: str) -> None:
    with pytest.raises(InvalidFieldError, match=message) as caught:
        _spec(**kind)
    assert caught.value.field == field


@pytest.fixture(scope="module")
def backend() -> LlguidanceBackend:
    tokenizer = Tokenizer.from_dir(default_model_dir())
    return LlguidanceBackend(tokenizer.to_json(), tokenizer.vocab_size, [2])


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ({"regex": "a(b"}, "unclosed group"),
        ({"json_schema": '{"type": "object", "propertyNames": {"pattern": "a"}}'}, "propertyNames"),
        ({"json_schema": '{"type": "string", "format": "no-such-format"}'}, "no-such-format"),
        ({"grammar": "start: undefined_rule"}, "undefined_rule"),
    ],
)
def test_what_llguidance_refuses_names_the_field(backend: LlguidanceBackend, kind: dict, message: str) -> None:
    spec = _spec(**kind)
    with pytest.raises(InvalidFieldError, match=message) as caught:
        backend.compile(spec)
    assert caught.value.field == spec.field


def _text_of(backend: LlguidanceBackend, spec: StructuredSpec, tokenizer: Tokenizer, text: str) -> bool:
    """Whether the compiled grammar accepts exactly `text` (tokenized as the model would emit it)."""
    matcher = backend.compile(spec).new_matcher()
    ids = tokenizer._fast.encode(text, add_special_tokens=False).ids
    return all(matcher.accept(t) for t in ids) and matcher.is_finished


def test_compiled_grammars_accept_what_they_describe(backend: LlguidanceBackend) -> None:
    tokenizer = Tokenizer.from_dir(default_model_dir())
    choice = _spec(choice=api_pb2.ChoiceList(choices=['say "hi"', "no"]))
    assert _text_of(backend, choice, tokenizer, 'say "hi"')
    assert not _text_of(backend, choice, tokenizer, "say")
    date = _spec(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
    assert _text_of(backend, date, tokenizer, "2024-05-17")
    schema = _spec(json_schema='{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}')
    assert _text_of(backend, schema, tokenizer, '{"a": 12}')
    # no free whitespace: the separators are fixed, so a small model cannot pad forever
    matcher = backend.compile(schema).new_matcher()
    newline = tokenizer._fast.encode("{\n", add_special_tokens=False).ids
    assert not all(matcher.accept(t) for t in newline)


class _CountingBackend:
    name = "counting"

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()

    def compile(self, spec: StructuredSpec):
        self.calls += 1
        self.release.wait(10)
        if spec.text == "bad":
            raise InvalidFieldError(spec.field, "refused")
        return object()


def test_the_compiler_shares_one_compilation_caches_it_and_does_not_cache_refusals() -> None:
    backend = _CountingBackend()
    compiler = GrammarCompiler(lambda: backend, max_cached=2)
    good = StructuredSpec("regex", "structured.regex", text="a")

    async def scenario() -> None:
        first = [asyncio.create_task(compiler.compile(good)) for _ in range(5)]
        await asyncio.sleep(0)  # let them all reach the shared compilation
        backend.release.set()
        results = await asyncio.gather(*first)
        assert len({id(r) for r in results}) == 1 and backend.calls == 1
        assert await compiler.compile(StructuredSpec("regex", "guided_regex", text="a")) is results[0]
        assert backend.calls == 1  # cached by the spec, whatever field it came in
        for _ in range(2):
            with pytest.raises(InvalidFieldError):
                await compiler.compile(StructuredSpec("regex", "structured.regex", text="bad"))
        assert backend.calls == 3
        for text in ("b", "c"):  # evicts "a" (LRU of 2)
            await compiler.compile(StructuredSpec("regex", "structured.regex", text=text))
        await compiler.compile(good)
        assert backend.calls == 6

    asyncio.run(scenario())
