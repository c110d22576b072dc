"""The tool-call formats `--tool-call-format` can name: how calls are shown, forced and parsed.

A format is three things that must agree: the fallback chat template that shows tools and
earlier calls to a model whose own template does not (`template`, shipped as a package
file), the grammar that forces calls for `required` and a named function
(`forced_grammar`), and the parser that takes calls out of a completion's text (`parser`).
Whatever template renders the prompt, the output is parsed in the server's format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Protocol

from kvserve.scheduler.server.tools import hermes_format
from kvserve.scheduler.server.tools.hermes_format import HermesParser, Parsed
from kvserve.scheduler.server.tools.tool_use import ToolUse


class ToolCallParser(Protocol):
    """One completion's parser: text deltas in, content and completed calls out."""

    done: bool
    """True once no further call may come (parallel calls off and one made): stop the completion."""

    def push(self, text: str) -> Parsed: ...

    def finish(self) -> Parsed: ...


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    name: str
    template_file: str
    fits: Callable[[str | None], bool]
    """Whether the fallback template can stand in for a model's own template."""
    forced_grammar: Callable[[ToolUse], str]
    parser: Callable[[ToolUse], ToolCallParser]

    def template(self) -> str:
        return resources.files(__package__).joinpath("templates", self.template_file).read_text(encoding="utf-8")

    def fallback_for(self, model_template: str | None) -> str | None:
        """The fallback template for a model whose template is `model_template`, if it fits."""
        return self.template() if self.fits(model_template) else None


FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat(
        name="hermes",
        template_file="hermes.jinja",
        fits=hermes_format.fits,
        forced_grammar=hermes_format.forced_grammar,
        parser=lambda use: HermesParser(use.names, parallel=not use.one_call),
    ),
}
"""Every format by its `--tool-call-format` name."""
