"""Servers with the OpenAI-compatible HTTP API on (`http=True`) for the tests of tests/http.

The HTTP API runs inside `kvserve serve --executor fake`, on a free port of its own
(`ServeProcess.http_url`); SDK clients and polling helpers are in `http_clients.py`.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.testing.server_launcher import ServeProcess, start_serve
from tests.http.http_clients import FAKE_ARGS
from tests.shared_servers import kept_clean


@pytest.fixture(scope="module")
def _http_server_process() -> Iterator[ServeProcess]:
    """One fake-executor server with HTTP on, shared by a module's tests."""
    tmp_dir = Path(tempfile.mkdtemp(prefix="kvserve-http-"))
    server = start_serve(FAKE_ARGS, tmp_dir, http=True)
    try:
        server.wait_serving()
        yield server
    finally:
        server.stop()
        shutil.rmtree(tmp_dir, ignore_errors=True)


@pytest.fixture
def http_server(_http_server_process: ServeProcess, request: pytest.FixtureRequest) -> Iterator[ServeProcess]:
    """The module's fake-executor HTTP server, checked clean after each test (tests/shared_servers.py)."""
    with kept_clean(_http_server_process, request.node.nodeid) as server:
        yield server
