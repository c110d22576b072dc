"""What tests need to share one server safely: its configuration, and the check that a test left it clean."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from kvserve.testing.server_launcher import ServeProcess

REAL_MODEL_ARGS = ["--executor", "torch", "--kv-cache-gb", "0.25"]
"""The default real-model configuration: the default model on the CPU executor, a small pool."""


@contextlib.contextmanager
def kept_clean(server: ServeProcess, test_name: str) -> Iterator[ServeProcess]:
    """Lend a shared `server` to one test, then fail that test by name if it left the server dirty."""
    restarts = server.stats().executor_restarts
    yield server
    assert_clean(server, test_name, restarts)


def assert_clean(server: ServeProcess, test_name: str, executor_restarts: int) -> None:
    """Fail `test_name` if it left the shared `server` with work or references, or replaced its executor."""
    if server.process.poll() is not None:
        pytest.fail(f"{test_name} left the shared server dead (exit {server.process.returncode})")
    stats = server.wait_idle(timeout_s=60.0)
    dirty = {
        name: getattr(stats, name)
        for name in ("requests_running", "requests_waiting", "requests_swapped", "blocks_referenced")
        if getattr(stats, name)
    }
    if stats.executor_restarts != executor_restarts:
        dirty["executor_restarts"] = stats.executor_restarts - executor_restarts
    if dirty:
        pytest.fail(f"{test_name} left the shared server dirty: {dirty}")
