"""The `copy` workload: real requests whose answers copy their prompts, speculative decoding's case.

Editing is what users ask of a model all day: repeat a passage, rewrite it with one change,
correct its spelling, fix the bug in a function and return the whole function. Most of each
answer is the prompt's own text, which prompt lookup can propose and a single forward pass
can verify. The passages are the public-domain prose that `bench quality` scores
(`data/quality_text.txt`) and small buggy functions written for kvserve (`data/copy_code.txt`);
each request is one chat turn rendered with the model's own chat template.

Like every workload, requests set `ignore_eos` and a fixed `max_tokens`: the passage's own
length plus a little, so the answer is mostly the copy and every configuration generates the
same number of tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from kvserve.bench.sessions import Session, Turn, Workload

NAME = "copy"
PROSE_TASKS = {
    "repeat": "Repeat the following text exactly, word for word:\n\n{text}",
    "rewrite": "Rewrite this paragraph, changing only the word '{old}' to '{new}':\n\n{text}",
    "spelling": "Correct the spelling in this paragraph and return it in full:\n\n{text}",
}
CODE_TASK = "Fix the bug in this function and return the whole corrected function:\n\n```python\n{text}```"
MIN_PASSAGE_CHARS = 150
MAX_PASSAGE_CHARS = 700
EXTRA_OUTPUT_TOKENS = 16
"""Beyond the passage's own length: room for the chat formatting and a closing remark."""
REPLACEMENTS = {"the": "a", "was": "is", "and": "or", "of": "from", "it": "this", "in": "within"}


def _data(name: str) -> str:
    return resources.files("kvserve.bench").joinpath(f"data/{name}").read_text(encoding="utf-8")


def passages() -> list[str]:
    """The prose paragraphs, each cut at a sentence end to at most `MAX_PASSAGE_CHARS`."""
    out = []
    for paragraph in _data("quality_text.txt").split("\n\n"):
        text = paragraph.strip()
        if text.startswith("#") or len(text) < MIN_PASSAGE_CHARS:
            continue
        if len(text) > MAX_PASSAGE_CHARS:
            cut = text.rfind(". ", 0, MAX_PASSAGE_CHARS)
            text = text[: cut + 1] if cut >= MIN_PASSAGE_CHARS else text[:MAX_PASSAGE_CHARS]
        out.append(text)
    return out


def code_snippets() -> list[str]:
    body = "\n".join(line for line in _data("copy_code.txt").splitlines() if not line.startswith("#"))
    return [snippet.strip("\n") + "\n" for snippet in body.split("----\n") if snippet.strip()]


def _misspell(rng: random.Random, text: str) -> str:
    """Three words with two letters swapped."""
    words = text.split(" ")
    long_words = [i for i, w in enumerate(words) if len(w) > 4 and w.isalpha()]
    for i in rng.sample(long_words, min(3, len(long_words))):
        w = words[i]
        j = rng.randrange(1, len(w) - 2)
        words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)


def _request_text(rng: random.Random, task: str, text: str) -> str:
    if task == "code":
        return CODE_TASK.format(text=text)
    if task == "spelling":
        return PROSE_TASKS[task].format(text=_misspell(rng, text))
    if task == "rewrite":
        words = {w.lower() for w in text.split()}
        old = next((w for w in REPLACEMENTS if w in words), "the")
        return PROSE_TASKS[task].format(old=old, new=REPLACEMENTS[old], text=text)
    return PROSE_TASKS[task].format(text=text)


class TextEncoder(Protocol):
    def encode(self, text: str) -> list[int]:
        """The text's token ids."""
        ...

    def encode_chat(self, text: str) -> list[int]:
        """One user message rendered with the model's chat template, as token ids."""
        ...


def copy_workload(num_requests: int, seed: int, encoder: TextEncoder, max_tokens_cap: int | None = None) -> Workload:
    """`num_requests` editing requests, no two alike until every (task, passage) pair is used."""
    encode, encode_chat = encoder.encode, encoder.encode_chat
    rng = random.Random(f"{NAME}:{seed}")
    pairs = [(task, text) for text in passages() for task in PROSE_TASKS] + [("code", c) for c in code_snippets()]
    rng.shuffle(pairs)
    sessions = []
    for i in range(num_requests):
        task, text = pairs[i % len(pairs)]
        max_tokens = len(encode(text)) + EXTRA_OUTPUT_TOKENS
        if max_tokens_cap:
            max_tokens = min(max_tokens, max_tokens_cap)
        prompt = encode_chat(_request_text(rng, task, text))
        sessions.append(Session(f"{NAME}-{i}-{task}", [Turn(prompt, max_tokens)]))
    return Workload(NAME, sessions)


class ModelTextEncoder:
    """`encode` and `encode_chat` with a model directory's tokenizer and chat template, loaded on first use."""

    def __init__(self, model_dir: Callable[[], Path]) -> None:
        self._model_dir = model_dir
        self._tokenizer: Any = None

    def _get(self) -> Any:
        if self._tokenizer is None:
            from kvserve.scheduler.server.intake.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_dir(self._model_dir())
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._get().encode(text))

    def encode_chat(self, text: str) -> list[int]:
        from kvserve.scheduler.server.intake.tokenizer import ChatMessage

        return list(self._get().encode_chat([ChatMessage(role="user", content=text)]))
