"""The kernels stage: `pytest -m cuda` judged from its junit XML (this module, a plugin too, tags multi-GPU tests)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import xml.etree.ElementTree as ET
from typing import Any

from kvserve.child_python import python_module
from kvserve.gpu_check.report import Outcome, StageContext
from kvserve.gpu_check.wheel_list import REPO_ROOT

WORKERS = 6  # of the GPU machine's 16 cores: the models stage runs beside this one
MULTI_GPU = "multi_gpu"
TINY_MODELS = "tests.executor.test_tiny_models::"
OUTCOMES = ("passed", "failed", "skipped", "skipped_multi_gpu")


def pytest_collection_modifyitems(items: list[Any]) -> None:
    """The plugin hook: a `multi_gpu` property on the junit record of every multi-GPU test."""
    for item in items:
        if item.get_closest_marker(MULTI_GPU):
            item.user_properties.append((MULTI_GPU, "1"))


def junit_outcomes(root: ET.Element) -> dict[str, list[str]]:
    """Test ids by outcome: passed, failed (failure or error), skipped, skipped_multi_gpu."""
    found: dict[str, list[str]] = {k: [] for k in OUTCOMES}
    for case in root.iter("testcase"):
        skipped = "skipped_multi_gpu" if any(p.get("name") == MULTI_GPU for p in case.iter("property")) else "skipped"
        failed = case.find("failure") is not None or case.find("error") is not None
        outcome = "failed" if failed else skipped if case.find("skipped") is not None else "passed"
        found[outcome].append(f"{case.get('classname')}::{case.get('name')}")
    return found


def _verdict(ctx: StageContext, prefix: str = "") -> tuple[bool, str, dict[str, int], dict[str, list[str]]]:
    """(ok, summary, counts, ids) of the tests under `prefix`: none failed; on the GPU some ran, only multi-GPU skip."""
    junit, cuda = ctx.out_dir / "pytest_cuda.xml", ctx.sizes.device == "cuda"
    found = junit_outcomes(ET.parse(junit).getroot()) if junit.is_file() else {}
    ids = {k: [n for n in v if n.startswith(prefix)] for k, v in found.items()}
    counts = {k: len(ids.get(k, [])) for k in OUTCOMES}
    unexpected_skips = counts["skipped"] if cuda else 0
    ok = not counts["failed"] and not unexpected_skips and (counts["passed"] > 0 or not cuda)
    summary = ", ".join(f"{counts[k]} {k}" for k in OUTCOMES[:3])
    summary += f", {counts['skipped_multi_gpu']} multi-GPU skipped"
    summary += ": a single-GPU test skipped on the GPU (CUDA not seen?)" if unexpected_skips else ""
    return ok, summary, counts, ids


def run_pytest_cuda(ctx: StageContext) -> Outcome:
    junit, log_path, cuda = ctx.out_dir / "pytest_cuda.xml", ctx.out_dir / "pytest_cuda.log", ctx.sizes.device == "cuda"
    command = python_module("pytest", "-m", "cuda", "-q", "-rfE", "-p", "no:cacheprovider")
    command += ["-p", "kvserve.gpu_check.pytest_check", f"--junitxml={junit}"]
    workers = WORKERS if cuda and importlib.util.find_spec("xdist") is not None else 1
    command += ["-n", str(workers)] if workers > 1 else []
    env = {k: v for k, v in os.environ.items() if not (cuda and k == "TRITON_INTERPRET")}
    with log_path.open("w") as log:
        run = subprocess.run(command, check=False, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
    ok, summary, counts, ids = _verdict(ctx)
    figures: dict[str, Any] = {"exit_code": run.returncode, "workers": workers, "log": str(log_path), "tail": tail}
    figures.update(counts, failing=ids.get("failed", [])[:20], skipped_multi_gpu_tests=ids.get("skipped_multi_gpu", []))
    ok = ok and run.returncode == 0
    error = None if ok else "\n".join([*figures["failing"], *tail])
    return Outcome(ok, f"{summary} (exit {run.returncode})", figures, error=error)


def tiny_models_result(ctx: StageContext) -> Outcome:
    """test_tiny_models.py's CUDA cases of that run: tiny fp32 models, both backends, logits within 2e-4 of HF's."""
    ok, summary, counts, cases = _verdict(ctx, TINY_MODELS)
    ok = ok and any(cases.values())  # the module ran (on CPU its CUDA cases are skipped)
    error = None if ok else "\n".join(cases.get("failed") or cases.get("skipped") or ["no test_tiny_models result"])
    return Outcome(ok, f"test_tiny_models.py on CUDA: {summary}", {**counts, "tests": cases}, error=error)
