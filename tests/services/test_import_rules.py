"""The scheduler process must stay free of torch, triton, transformers and the executor package
(`kvserve serve`'s parser reads the executor's flags from its config modules, which load no torch)."""

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


SERVE_SCRIPT = """
import sys
from kvserve.cli import build_parser
from kvserve.commands.serve import child_executor_from_args, executor_args
from kvserve.config.flags import config_from_args
from kvserve.scheduler.server.server_config import ServerConfig
args = build_parser().parse_args(["serve", "--dtype", "float32", "--weights", "native", "-tp", "2", "--strict"])
argv = executor_args(child_executor_from_args(args), config_from_args(ServerConfig, args), "ipc:///x")
assert "--weights" in argv, argv
print("FORBIDDEN", ",".join(sorted(m for m in ("torch", "triton", "transformers") if m in sys.modules)))
"""


def test_serve_takes_the_executors_flags_without_loading_torch() -> None:
    """`kvserve serve` runs the scheduler in its own process: parsing the executor's flags there and
    building the child's command line must not load torch."""
    out = subprocess.run([sys.executable, "-c", SERVE_SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "FORBIDDEN"  # and nothing after it
