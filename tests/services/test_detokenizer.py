"""Incremental detokenization and stop strings, against the default model's real tokenizer."""

from __future__ import annotations

import pytest

from kvserve.scheduler.server.delivery.detokenizer import CompletionText, IncrementalDetokenizer, StopStringMatcher
from kvserve.scheduler.server.intake.tokenizer import Tokenizer

MULTI_BYTE_TEXTS = [
    "北京是中华人民共和国的首都。",
    "Party time 🎉🎊 family 👩‍👩‍👧‍👦 flags 🇫🇷🇯🇵 done",
    "naïve café — «quotes» Ελληνικά русский 日本語のテキスト",
    "mixed: 你好, world! 😀 x²+y²=z² ∑∫√",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
def test_multibyte_text_streamed_token_by_token_reassembles_exactly(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # some characters really are split over several tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([token]) for token in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_a_split_character_is_held_back_until_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push([ids[-1]]) == "🎉"


def test_special_tokens_are_hidden(tokenizer: Tokenizer) -> None:
    im_end = tokenizer.token_id("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer)
    out = detok.push(tokenizer.encode("Hello")) + detok.push([im_end]) + detok.flush()
    assert out == "Hello"


def test_prompt_context_is_not_emitted_and_keeps_the_leading_space(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("The answer is")
    output = tokenizer.encode(" forty two")
    detok = IncrementalDetokenizer(tokenizer, prompt_tail=prompt[-4:])
    assert "".join(detok.push([t]) for t in output) + detok.flush() == " forty two"


@pytest.mark.parametrize("stop", ["ha be", "世界", "🎉!", "ta\n\nga"])
def test_stop_string_spanning_tokens_is_trimmed(tokenizer: Tokenizer, stop: str) -> None:
    text = "alpha beta 世界 🎉! beta\n\ngamma"
    ids = tokenizer.encode(text)
    assert not any(stop in tokenizer.decode([t]) for t in ids)  # no single token holds the stop string
    completion = CompletionText(tokenizer, (stop, "never-seen"))
    out = ""
    for token in ids:
        out += completion.push([token])
        if completion.stopped:
            break
    out += completion.finish()
    assert completion.stopped
    assert out == text[: text.index(stop)]


def test_text_that_only_looks_like_a_stop_string_prefix_is_released_on_finish(tokenizer: Tokenizer) -> None:
    completion = CompletionText(tokenizer, ("STOPPER",))
    out = "".join(completion.push([t]) for t in tokenizer.encode("a STOP"))
    assert out == "a "  # "STOP" might still become "STOPPER": held back
    assert out + completion.finish() == "a STOP"
    assert not completion.stopped


def test_matcher_picks_the_earliest_stop_string() -> None:
    matcher = StopStringMatcher(("bc", "ab"))
    assert matcher.push("xa") == "x"
    assert matcher.push("bcd") == ""
    assert matcher.matched == "ab"
    assert matcher.push("more") == "" and matcher.flush() == ""


def test_matcher_holds_only_a_possible_prefix() -> None:
    matcher = StopStringMatcher(("<end>",))
    assert matcher.push("hello <e") == "hello "
    assert matcher.push("x") == "<ex"
    assert matcher.push("<en") == ""
    assert matcher.push("d> tail") == ""
    assert matcher.matched == "<end>"


def test_chat_template_renders_with_generation_prompt(tokenizer: Tokenizer) -> None:
    from kvserve.scheduler.server.intake.tokenizer import ChatMessage

    text = tokenizer.render_chat([ChatMessage("user", "What is the capital of France?")])
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    ids = tokenizer.encode_chat([ChatMessage("user", "hi")])
    assert ids.count(tokenizer.token_id("<|im_start|>")) == 3  # system (default), user, assistant


def test_chat_template_runs_sandboxed() -> None:
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers.models import WordLevel

    from kvserve.scheduler.server.intake.tokenizer import ChatMessage, ChatTemplateError

    fast = FastTokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    evil = Tokenizer(fast, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        evil.render_chat([ChatMessage("user", "x")])
