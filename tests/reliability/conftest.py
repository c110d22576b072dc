"""Fixtures for the fault-injection suite: servers that are always torn down, processes and all."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvserve.testing.server_launcher import ServeProcess, serving


@pytest.fixture
def serve(serve_factory: Callable[..., ServeProcess]) -> Callable[..., ServeProcess]:
    """`serve(args, wait=True, host=...)` starts `kvserve serve`; every server is killed at teardown."""
    return serve_factory


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """One fake-executor server shared by a module's tests, started with the module's `SERVER_ARGS`.

    The modules differ only in the pool and step latency they need, so the start-up, the log directory
    and the teardown live here once.
    """
    args = getattr(request.module, "SERVER_ARGS", None)
    assert args is not None, f"{request.module.__name__} uses `server` but sets no SERVER_ARGS"
    name = request.module.__name__.rsplit(".", 1)[-1]
    with serving(["--executor", "fake", *args], tmp_path_factory.mktemp(name)) as process:
        yield process
