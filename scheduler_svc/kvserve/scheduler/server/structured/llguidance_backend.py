"""The llguidance grammar engine behind `GrammarBackend`.

JSON is generated compactly (", " and ": " separators, no free whitespace): with
flexible whitespace a small model can emit newlines forever and never close the object,
the failure users of other engines report most. A choice becomes a Lark alternation of
JSON-quoted literals, so quotes and backslashes in a choice are matched literally.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from llguidance import LLMatcher, LLTokenizer

from kvserve.protos.sampling import InvalidFieldError
from kvserve.scheduler.server.structured.spec import StructuredSpec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in the stub only

JSON_OPTIONS: JsonCompileOptions = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_ANY_OBJECT = '{"type": "object"}'
_MAX_ERROR_CHARS = 500
"""Engine messages can quote a whole grammar; the client gets the first lines."""


class LlguidanceMatcher:
    """`TokenMatcher` over an `LLMatcher` (each call releases the GIL inside llguidance)."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: LLMatcher) -> None:
        self._matcher = matcher

    def next_token_bitmask(self) -> bytes:
        return self._matcher.compute_bitmask()

    def accept(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self._matcher.get_error()}")

    @property
    def is_finished(self) -> bool:
        return self._matcher.is_stopped()


class LlguidanceGrammar:
    """`MatcherFactory`: a compiled matcher in its start state, copied per completion (microseconds)."""

    __slots__ = ("_template",)

    def __init__(self, template: LLMatcher) -> None:
        self._template = template

    def new_matcher(self) -> LlguidanceMatcher:
        return LlguidanceMatcher(self._template.deep_copy())


class LlguidanceBackend:
    """Compiles specs for one tokenizer; building it indexes the vocabulary (about half a second)."""

    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)

    def compile(self, spec: StructuredSpec) -> LlguidanceGrammar:
        try:
            grammar = grammar_text(spec)
        except ValueError as exc:  # llguidance refuses some specs while translating them
            raise InvalidFieldError(spec.field, _short(str(exc))) from None
        matcher = LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidFieldError(spec.field, _short(matcher.get_error()))
        return LlguidanceGrammar(matcher)


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar for a spec."""
    if spec.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_OPTIONS)
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choices)
    return spec.text


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + "…"
