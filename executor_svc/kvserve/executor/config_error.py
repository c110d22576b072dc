"""The one exception for a configuration the executor refuses, apart from everything that imports torch."""

from __future__ import annotations


class ExecutorConfigError(ValueError):
    """The configuration names something the executor cannot load or run: a model that is not
    there, weights in a format a mode needs, a refused flag combination. `kvserve executor` exits
    with code 2 and this message, without a traceback: it is the user's input, not a fault."""
