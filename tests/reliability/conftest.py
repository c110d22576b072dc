"""Fixtures for the fault-injection suite: servers that are always torn down, processes and all."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.reliability.serve_harness import ServeProcess, start_serve


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., ServeProcess]]:
    """`serve(args, wait=True, host=...)` starts `kvserve serve`; every server is killed at teardown."""
    started: list[ServeProcess] = []

    def start(args: list[str], *, wait: bool = True, host: str = "127.0.0.1") -> ServeProcess:
        server = start_serve(args, tmp_path, host=host)
        started.append(server)
        if wait:
            server.wait_serving()
        return server

    yield start
    for server in started:
        server.stop()
