"""The scheduler's tokenizer: `tokenizer.json` through the `tokenizers` library, plus the chat template.

The scheduler must stay free of torch and transformers, so it reads the files an
executor points at (`ExecutorInfo.tokenizer_path`) directly: the fast tokenizer from
`tokenizer.json`, special tokens from its `added_tokens`, and the chat template from
`chat_template.jinja` or `tokenizer_config.json["chat_template"]` (or `--chat-template FILE`),
rendered in a jinja2 sandbox because a template is code that came with the model.

Tools and tool turns are rendered by that template when it knows them (it reads a `tools`
variable, as Hugging Face's `apply_chat_template(tools=...)` passes it); otherwise by the
tool-call format's fallback template, where that fits the model's turns; otherwise a request
with them is refused. Templates get Hugging Face's `tojson` (no HTML escaping), so a template
renders here as it does in transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import Template, meta
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as FastTokenizer

if TYPE_CHECKING:
    from kvserve.scheduler.server.tools.tool_formats import ToolCallFormat

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
"""Roles a chat prompt may use; anything else is refused by request validation."""


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed for these messages."""


@dataclass(slots=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[dict[str, Any], ...] = ()
    """An assistant turn's calls, shaped as templates take them (`tool_use.parse_call`)."""
    tool_call_id: str = ""

    @property
    def uses_tools(self) -> bool:
        return bool(self.tool_calls) or self.role == "tool"

    def template_dict(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = list(self.tool_calls)
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


class Tokenizer:
    """Encode prompts, render chat prompts, and decode token ids (special tokens hidden)."""

    def __init__(
        self,
        fast: FastTokenizer,
        *,
        chat_template: str | None,
        bos_token: str = "",
        eos_token: str = "",
        tool_format: ToolCallFormat | None = None,
    ) -> None:
        self._fast = fast
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._env.globals["raise_exception"] = _raise_template_error
        self._env.filters["tojson"] = _tojson
        self._template = self._env.from_string(chat_template) if chat_template else None
        self._tool_template: Template | None = None
        """What renders requests with tools or tool turns: the model's template if it knows them."""
        self.tool_template_source: str | None = None
        if chat_template and "tools" in meta.find_undeclared_variables(self._env.parse(chat_template)):
            self._tool_template, self.tool_template_source = self._template, "model"
        elif tool_format is not None:
            fallback = tool_format.fallback_for(chat_template)
            if fallback is not None:
                self._tool_template = self._env.from_string(fallback)
                self.tool_template_source = f"{tool_format.name} fallback"

    @classmethod
    def from_dir(
        cls, path: str | Path, *, chat_template: str | None = None, tool_format: ToolCallFormat | None = None
    ) -> Tokenizer:
        """Load from a directory holding tokenizer.json and optionally tokenizer_config.json / chat_template.jinja;
        `chat_template` (a template's text) replaces the model's own."""
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
            chat_template=chat_template if chat_template is not None else template,
            tool_format=tool_format,
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

    def render_chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None) -> str:
        """The chat prompt as text, ending with the assistant's generation prompt."""
        template = self._template
        if tools or any(m.uses_tools for m in messages):
            template = self._tool_template
            if template is None:
                raise ChatTemplateError(
                    "the chat template does not render tools or tool turns, and the tool-call format's fallback "
                    "template does not fit it; start the server with --chat-template FILE"
                )
        if template is None:
            raise ChatTemplateError("this model has no chat template; send a text or token_ids prompt")
        try:
            return template.render(
                messages=[m.template_dict() for m in messages],
                tools=tools or None,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None) -> list[int]:
        # The template already writes any BOS/special tokens as text; the tokenizer maps them to ids.
        return self._fast.encode(self.render_chat(messages, tools), add_special_tokens=False).ids


def _token_text(value: object) -> str:
    """tokenizer_config stores special tokens either as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def read_chat_template(path: str) -> str:
    """`--chat-template FILE`'s text, checked to parse, so a bad file stops the server at start."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        ImmutableSandboxedEnvironment().parse(text)
    except OSError as exc:
        raise ChatTemplateError(f"--chat-template {path}: {exc.strerror or exc}") from None
    except TemplateError as exc:
        raise ChatTemplateError(f"--chat-template {path}: not a valid Jinja template: {exc}") from None
    return text


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """Hugging Face's `tojson` for chat templates: plain JSON, not jinja's HTML-escaped variant."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)
