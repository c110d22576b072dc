"""The README's Python examples run as written (against the scripted server instead of a real one)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
EXAMPLE_TARGET = "127.0.0.1:50051"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_sync_and_async_examples() -> None:
    blocks = python_blocks()
    assert any("from kvserve.clients import Client" in b for b in blocks)
    assert any("from kvserve.clients import AsyncClient" in b for b in blocks)


@pytest.mark.parametrize("index", range(2))
def test_readme_example_runs(scripted_server, index: int, capsys: pytest.CaptureFixture) -> None:
    source = python_blocks()[index]
    assert EXAMPLE_TARGET in source
    exec(compile(source.replace(EXAMPLE_TARGET, scripted_server.target), f"README-block-{index}", "exec"), {})
    assert "w0" in capsys.readouterr().out
    assert scripted_server.servicer.recorded.requests, "the example sent no request"
