"""Where kvserve keeps what it builds once per machine: converted models, compiled kernels, probe results."""

from __future__ import annotations

import os
from pathlib import Path

from kvserve.config import defaults


def cache_dir() -> Path:
    """Root of kvserve's on-disk cache: $KVSERVE_CACHE, else ~/.cache/kvserve."""
    return Path(os.environ.get(defaults.CACHE_DIR_ENV) or Path.home() / ".cache" / "kvserve")
