"""The command line of a Python child: the same interpreter, running a module with `-m`."""

from __future__ import annotations

import sys


def python_module(module: str, *args: str) -> list[str]:
    """The command that runs `python -m module args...` in this interpreter."""
    return [sys.executable, "-m", module, *args]
