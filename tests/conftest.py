"""Fixtures shared by every test directory."""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvserve.testing.server_launcher import ServeProcess, serving, start_serve
from tests.shared_servers import REAL_MODEL_ARGS, kept_clean

REPO_ROOT = Path(__file__).resolve().parent.parent


pytest_plugins = ["tests.time_budget"]


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


@pytest.fixture(scope="session")
def _real_model_server_process(default_model_dir) -> Iterator[ServeProcess]:
    with serving(REAL_MODEL_ARGS, http=True, name="real-model") as server:
        yield server


@pytest.fixture
def real_model_server(_real_model_server_process: ServeProcess, request) -> Iterator[ServeProcess]:
    """The session's one real-model server (`REAL_MODEL_ARGS`, HTTP on), for tests that only send requests.

    Loading the default model costs tens of seconds, so every such test shares one server. A test
    that kills, pauses, restarts, fills or reconfigures a server starts its own instead. After each
    test the server must be clean again (nothing waiting, running, swapped or referenced, and its
    executor never replaced); a test that leaves it otherwise fails by name.
    """
    with kept_clean(_real_model_server_process, request.node.nodeid) as server:
        yield server
