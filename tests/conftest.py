"""Fixtures shared by every test directory."""

from __future__ import annotations

import functools
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvserve.testing.server_launcher import ServeProcess, start_serve

REPO_ROOT = Path(__file__).resolve().parent.parent


def _checkout_root_last() -> None:
    """Keep the checkout's root on `sys.path` (tests import `tests.*`), but after the installed packages.

    `python -m pytest` puts the working directory first, and from there the checkout's top-level
    `kernels/` would shadow Hugging Face's `kernels` package, which transformers imports when it loads
    a model. kvserve's own code is imported as `kvserve.*` either way; children start with `-P`
    (`kvserve.child_python`).
    """
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != REPO_ROOT]
    sys.path.append(str(REPO_ROOT))


_checkout_root_last()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model converted to a safetensors directory (converted once, then cached)."""
    from kvserve.executor.weights.model_store import ensure_model_dir

    return ensure_model_dir()


@pytest.fixture
def serve_factory() -> Iterator[Callable[..., ServeProcess]]:
    """`start(args, wait=True, host=...)` runs `kvserve serve`; every server is stopped (groups killed) at teardown."""
    started: list[ServeProcess] = []
    tmp_dir = Path(tempfile.mkdtemp(prefix="kvserve-test-"))

    def start(args: list[str], *, wait: bool = True, host: str = "127.0.0.1", http: bool = False) -> ServeProcess:
        server = start_serve(args, tmp_dir, host=host, http=http)
        started.append(server)
        if wait:
            server.wait_serving()
        return server

    yield start
    for server in started:
        server.stop()
    shutil.rmtree(tmp_dir, ignore_errors=True)


@pytest.fixture
def http_serve_factory(serve_factory) -> Callable[..., ServeProcess]:
    """`start(args, wait=True)`: `kvserve serve ARGS` with the HTTP API on too, on a free port."""
    return functools.partial(serve_factory, http=True)
