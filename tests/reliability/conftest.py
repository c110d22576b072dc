"""Fixtures for the fault-injection suite: servers that are always torn down, processes and all."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvserve.testing.server_launcher import ServeProcess


@pytest.fixture
def serve(serve_factory: Callable[..., ServeProcess]) -> Callable[..., ServeProcess]:
    """`serve(args, wait=True, host=...)` starts `kvserve serve`; every server is killed at teardown."""
    return serve_factory
