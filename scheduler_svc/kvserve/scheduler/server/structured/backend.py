"""The one interface a grammar engine implements for kvserve, so another could be added.

A backend compiles a `StructuredSpec` for the served tokenizer into a `MatcherFactory`
(the core's protocol: one matcher per completion), raising `InvalidFieldError` naming
the spec's field when the engine refuses it. Compiling may take up to a second for a
large schema, so `GrammarCompiler` runs it off the event loop and caches the result.

llguidance is the engine (`llguidance_backend`): it runs in the scheduler process, which
must not import torch, and it needs none; xgrammar imports torch, so it could serve only
from the executor.
"""

from __future__ import annotations

from typing import Protocol

from kvserve.scheduler.core import MatcherFactory
from kvserve.scheduler.server.structured.spec import StructuredSpec


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: StructuredSpec) -> MatcherFactory:
        """Compile `spec`; raise InvalidFieldError(spec.field, why) if the engine refuses it."""
        ...
