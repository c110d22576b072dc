"""Helpers for the end-to-end bench tests: run the CLI in a subprocess, like a user would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def run_kvserve(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvserve", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=Path(__file__).resolve().parents[2],
    )


@pytest.fixture
def kvserve_cli():
    return run_kvserve
