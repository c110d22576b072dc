"""The scheduler's tokenizer: `tokenizer.json` through the `tokenizers` library, plus the chat template.

The scheduler must stay free of torch and transformers, so it reads the files an
executor points at (`ExecutorInfo.tokenizer_path`) directly: the fast tokenizer from
`tokenizer.json`, special tokens from its `added_tokens`, and the chat template from
`chat_template.jinja` or `tokenizer_config.json["chat_template"]`, rendered in a jinja2
sandbox because a template is code that came with the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as FastTokenizer

CHAT_ROLES = frozenset({"system", "user", "assistant"})
"""Roles a chat prompt may use; anything else is refused by request validation."""


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed for these messages."""


@dataclass(slots=True)
class ChatMessage:
    role: str
    content: str


class Tokenizer:
    """Encode prompts, render chat prompts, and decode token ids (special tokens hidden)."""

    def __init__(
        self, fast: FastTokenizer, *, chat_template: str | None, bos_token: str = "", eos_token: str = ""
    ) -> None:
        self._fast = fast
        self.chat_template_source = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.special_token_ids: frozenset[int] = frozenset(
            tok_id for tok_id, tok in fast.get_added_tokens_decoder().items() if tok.special
        )
        self._template = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(chat_template)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a directory holding tokenizer.json and optionally tokenizer_config.json / chat_template.jinja."""
        path = Path(path)
        fast = FastTokenizer.from_file(str(path / "tokenizer.json"))
        config: dict = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        template: str | None = None
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        return cls(
            fast,
            chat_template=template,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
        )

    @property
    def vocab_size(self) -> int:
        return self._fast.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what the grammar engine indexes)."""
        return self._fast.to_str()

    def token_id(self, token: str) -> int | None:
        return self._fast.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._fast.encode(text, add_special_tokens=True).ids

    def tokens(self, ids: list[int]) -> list[str]:
        return [self._fast.id_to_token(i) or "" for i in ids]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[ChatMessage]) -> str:
        """The chat prompt as text, ending with the assistant's generation prompt."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send a text or token_ids prompt")
        try:
            return self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        # The template already writes any BOS/special tokens as text; the tokenizer maps them to ids.
        return self._fast.encode(self.render_chat(messages), add_special_tokens=False).ids


def _token_text(value: object) -> str:
    """tokenizer_config stores special tokens either as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)
