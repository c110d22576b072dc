"""The interpreter command line every kvserve process starts a Python child with.

`python -m X` and `python -c ...` put the working directory first on the child's `sys.path`.
Started from a checkout's root (as `make serve`, the tests and the GPU check are), the child would
then import the checkout's top-level folders by their bare names before any installed package:
`kernels/` shadows Hugging Face's `kernels` package, which transformers imports when it loads a
model, and the child dies of an ImportError. `-P` (Python 3.11 and later, which kvserve requires)
leaves the working directory off `sys.path`; the checkout's code is reached as `kvserve.*`, through
the installed package, either way.
"""

from __future__ import annotations

import sys

PYTHON: tuple[str, ...] = (sys.executable, "-P")
"""The interpreter and its flags; a child's command is `[*PYTHON, "-m", module, ...]`."""


def python_module(module: str, *args: str) -> list[str]:
    """The command that runs `python -m module args...` without the working directory on `sys.path`."""
    return [*PYTHON, "-m", module, *args]
