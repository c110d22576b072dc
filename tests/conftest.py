"""Fixtures shared by every test directory."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model converted to a safetensors directory (converted once, then cached)."""
    from executor_svc.model_store import ensure_model_dir

    return ensure_model_dir()
