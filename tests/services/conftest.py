"""A module-scoped fake-executor server; `serve_factory` (tests/conftest.py) starts others."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.testing.server_launcher import ServeProcess, start_serve
from tests.shared_servers import kept_clean


@pytest.fixture(scope="module")
def _fake_server_process() -> Iterator[ServeProcess]:
    """One fake-executor server shared by a module's tests (fast: no model)."""
    tmp_dir = Path(tempfile.mkdtemp(prefix="kvserve-test-"))
    server = start_serve(["--executor", "fake", "--num-blocks", "4096", "--step-latency-ms", "2"], tmp_dir)
    try:
        server.wait_serving()
        yield server
    finally:
        server.stop()
        shutil.rmtree(tmp_dir, ignore_errors=True)


@pytest.fixture
def fake_server(_fake_server_process: ServeProcess, request: pytest.FixtureRequest) -> Iterator[ServeProcess]:
    """The module's fake-executor server, checked clean after each test (tests/shared_servers.py)."""
    with kept_clean(_fake_server_process, request.node.nodeid) as server:
        yield server
