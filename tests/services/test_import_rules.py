"""The scheduler process must stay free of torch, triton, transformers and the executor package."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import importlib, pkgutil, sys
import kvserve.scheduler
for mod in pkgutil.walk_packages(kvserve.scheduler.__path__, "kvserve.scheduler."):
    importlib.import_module(mod.name)
import kvserve.commands.serve, kvserve.commands.scheduler
loaded = sorted(m for m in ("torch", "triton", "transformers", "kvserve.executor") if m in sys.modules)
print("MODULES", len([m for m in sys.modules if m.startswith("kvserve.scheduler.")]))
print("FORBIDDEN", ",".join(loaded))
"""


def test_the_scheduler_never_imports_torch() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    lines = dict(line.split(" ", 1) if " " in line else (line, "") for line in out.stdout.splitlines())
    assert int(lines["MODULES"]) >= 10  # the modules really were imported
    assert lines["FORBIDDEN"] == ""
