"""Scripted replies (`--scripted-replies`, tests only): a prompt that says what the fake must answer.

A prompt holding `[[fake-reply]]TEXT[[/fake-reply]]` (the last such span, anywhere in the prompt, e.g. in
a chat's user message) is answered with the tokens of TEXT, as the model's tokenizer encodes it, and
then eos where eos may come. So a test can make the fake write exactly what a model might, such as tool-call
markup, and check what the server makes of it; the server decodes those tokens back into TEXT.

The reply is a function of the prompt alone (output position k gets the script's k-th token), so
recompute after preemption or an executor restart gives the same reply. Under a structured-output
mask a scripted token is drawn only where the mask allows it. The prompt is decoded with the
`tokenizers` library, loaded only when this option is on, from the fake's tokenizer directory.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

OPEN = "[[fake-reply]]"
CLOSE = "[[/fake-reply]]"
_DIRECTIVE = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def directive_text(text: str) -> str | None:
    """The TEXT of the last `[[fake-reply]]TEXT[[/fake-reply]]` in `text`, None without one."""
    found = _DIRECTIVE.findall(text)
    return found[-1] if found else None


class ScriptedReplies:
    """Finds a prompt's scripted reply: its token ids, or None for an ordinary prompt."""

    def __init__(self, tokenizer_dir: str) -> None:
        if not tokenizer_dir:
            raise ValueError("--scripted-replies needs a tokenizer (a model directory's tokenizer.json)")
        from tokenizers import Tokenizer

        self._tokenizer: Any = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))

    def script(self, prompt_ids: list[int]) -> list[int] | None:
        text = directive_text(self._tokenizer.decode(prompt_ids, skip_special_tokens=False))
        return None if text is None else self._tokenizer.encode(text, add_special_tokens=False).ids
