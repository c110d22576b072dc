"""`pytest -m cuda` on the GPU: the CUDA tests of the suite (tests/kernels/test_kernels_cuda.py).

It collects the whole suite, as `pytest -m cuda` anywhere would, so a test module that no
longer imports on the GPU image is a failure too. On the GPU a skipped CUDA test is a
failure (it means CUDA was not seen); in the CPU rehearsal every one is skipped. Most of its
time is Triton compiling one kernel per shape and dtype, one core each, so where pytest-xdist
is installed (it travels in .gpu-wheels/) the tests are spread over `WORKERS` processes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.gpu_check.results import Outcome

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import CheckContext

WORKERS = 6
"""Of the GPU machine's 16 cores: the models stage runs beside this one."""


def junit_counts(path: Path) -> dict[str, Any]:
    """Totals and the names of failing tests from a junit XML file (one or more test suites)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts: dict[str, Any] = {
        key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")
    }
    counts["time_s"] = round(sum(float(s.get("time", 0.0)) for s in suites), 1)
    failing = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failing.append(f"{case.get('classname')}::{case.get('name')}")
    counts["failing"] = failing[:20]
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def run_pytest_cuda(ctx: CheckContext) -> Outcome:
    junit = ctx.out_dir / "pytest_cuda.xml"
    log_path = ctx.out_dir / "pytest_cuda.log"
    command = [
        *(sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rfE", "-p", "no:cacheprovider"),
        f"--junitxml={junit}",
    ]
    parallel = ctx.scale.device == "cuda" and importlib.util.find_spec("xdist") is not None
    if parallel:
        command += ["-n", str(WORKERS)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} if ctx.scale.device == "cuda" else None
    with open(log_path, "w") as log_file:
        completed = subprocess.run(
            command, check=False, cwd=ctx.repo, stdout=log_file, stderr=subprocess.STDOUT, env=env
        )
    tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
    figures: dict[str, Any] = {
        "exit_code": completed.returncode,
        "workers": WORKERS if parallel else 1,
        "log": str(log_path),
        "tail": tail,
    }
    if junit.is_file():
        figures.update(junit_counts(junit))
    passed = figures.get("passed", 0)
    skipped = figures.get("skipped", 0)
    ok = completed.returncode == 0 and (skipped == 0 and passed > 0 if ctx.scale.device == "cuda" else True)
    summary = (
        f"{passed} passed, {figures.get('failures', 0) + figures.get('errors', 0)} failed, {skipped} skipped "
        f"in {figures.get('time_s', '?')}s (exit {completed.returncode})"
    )
    error = None if ok else "\n".join([*figures.get("failing", []), *tail])
    return Outcome(ok, summary, figures, error=error)
