"""The hermes tool-call parser: calls out, markup never in content, whatever the chunking."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from kvserve.scheduler.server.tools.hermes_format import HermesParser
from kvserve.scheduler.server.tools.tool_use import ToolCall

NAMES = frozenset({"get_weather", "add"})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def _run(text: str, cuts: list[int], parallel: bool = True) -> tuple[str, list[ToolCall], bool]:
    ids = itertools.count()
    parser = HermesParser(NAMES, parallel, new_id=lambda: f"call_{next(ids)}")
    content, calls = "", []
    bounds = [0, *sorted(cuts), len(text)]
    for start, end in itertools.pairwise(bounds):
        parsed = parser.push(text[start:end])
        content += parsed.content
        calls += parsed.calls
        assert "<tool_call" not in parsed.content or "broken" in text  # markup is held back, never streamed
    last = parser.finish()
    return content + last.content, calls + last.calls, parser.done


def _every_chunking(text: str, parallel: bool = True) -> set[tuple[str, tuple[ToolCall, ...]]]:
    """Results over single cuts everywhere and random multi-cut splits: one result if chunking is irrelevant."""
    rng = random.Random(0)
    splits = [[i] for i in range(len(text) + 1)] + [rng.sample(range(len(text)), k=5) for _ in range(50)]
    return {(c, tuple(calls)) for c, calls, _ in (_run(text, cut, parallel) for cut in splits)}


def test_a_lone_call_is_a_call_with_no_content_whatever_the_chunking() -> None:
    results = _every_chunking("\n" + CALL + "\n")
    assert len(results) == 1
    ((content, calls),) = results
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_text_around_calls_is_content_and_several_calls_come_in_order() -> None:
    ((content, calls),) = _every_chunking("Let me check. " + CALL + "\n" + CALL2 + " Done.")
    assert content == "Let me check. Done."
    assert [c.name for c in calls] == ["get_weather", "add"]
    assert [c.id for c in calls] == ["call_0", "call_1"]


def test_plain_text_is_returned_exactly_including_trailing_whitespace_and_lookalike_tags() -> None:
    text = "a < b and <tool> is not <tool_cal a tag \n\n"
    ((content, calls),) = _every_chunking(text)
    assert (content, calls) == (text, ())


@pytest.mark.parametrize(
    "body",
    [
        "{not json}",
        '{"name": "unknown_tool", "arguments": {}}',
        '{"name": "add", "arguments": [1, 2]}',
        '{"name": "add"}',
        '["add", {}]',
    ],
)
def test_a_broken_call_comes_back_as_text_never_as_a_call(body: str) -> None:
    text = f"broken <tool_call>{body}</tool_call> end"
    ((content, calls),) = _every_chunking(text)
    assert calls == ()
    assert content == text


def test_an_unclosed_call_counts_only_if_its_body_is_whole() -> None:
    whole = CALL.removesuffix("</tool_call>")
    ((content, calls),) = _every_chunking(whole)
    assert content == "" and [c.name for c in calls] == ["get_weather"]
    cut_off = '<tool_call>\n{"name": "get_weather", "argu'
    ((content, calls),) = _every_chunking(cut_off)
    assert calls == () and content == cut_off


def test_without_parallel_calls_the_first_call_ends_the_completion() -> None:
    content, calls, done = _run(CALL + "\n" + CALL2 + " more", [len(CALL) + 3], parallel=False)
    assert done and [c.name for c in calls] == ["get_weather"] and content == ""


def test_arguments_written_as_a_json_string_are_accepted() -> None:
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    ((_, calls),) = _every_chunking(text)
    assert json.loads(calls[0].arguments) == {"a": 1}
