"""`pytest -m cuda` on the GPU, judged from its junit XML: a skipped single-GPU test fails the check
(CUDA was not seen); a skipped `multi_gpu` test is reported as skipped (the machine has one GPU).
`runner_vs_hf_tiny` is the same run's verdict on tests/executor/test_tiny_models.py alone.

This module is also the pytest plugin (`-p`) that tags the multi-GPU tests in the XML.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING, Any

from kvserve.child_python import python_module
from kvserve.gpu_check.report import Outcome
from kvserve.gpu_check.wheel_list import REPO_ROOT

if TYPE_CHECKING:
    from kvserve.gpu_check.stage import StageContext

WORKERS = 6
"""Of the GPU machine's 16 cores: the models stage runs beside this one."""
MULTI_GPU = "multi_gpu"
TINY_MODELS = "tests.executor.test_tiny_models::"


def pytest_collection_modifyitems(items: list[Any]) -> None:
    """The plugin hook: a `multi_gpu` property on the junit record of every multi-GPU test."""
    for item in items:
        if item.get_closest_marker(MULTI_GPU):
            item.user_properties.append((MULTI_GPU, "1"))


def junit_outcomes(root: ET.Element) -> dict[str, list[str]]:
    """Test ids by outcome: passed, failed (failure or error), skipped, skipped_multi_gpu."""
    found: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": [], "skipped_multi_gpu": []}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        multi = any(p.get("name") == MULTI_GPU for p in case.iter("property"))
        if case.find("failure") is not None or case.find("error") is not None:
            found["failed"].append(name)
        elif case.find("skipped") is not None:
            found["skipped_multi_gpu" if multi else "skipped"].append(name)
        else:
            found["passed"].append(name)
    return found


def _outcomes(ctx: StageContext) -> dict[str, list[str]]:
    junit = ctx.out_dir / "pytest_cuda.xml"
    return junit_outcomes(ET.parse(junit).getroot()) if junit.is_file() else {}


def _verdict(ids: dict[str, list[str]], cuda: bool) -> tuple[bool, str, dict[str, Any]]:
    """(passed, summary, counts): nothing failed; on the GPU something passed and only multi-GPU tests skipped."""
    counts = {k: len(ids.get(k, [])) for k in ("passed", "failed", "skipped", "skipped_multi_gpu")}
    unexpected_skips = counts["skipped"] if cuda else 0
    ok = not counts["failed"] and not unexpected_skips and (counts["passed"] > 0 or not cuda)
    summary = ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "skipped"))
    summary += f", {counts['skipped_multi_gpu']} multi-GPU skipped"
    return ok, summary + (": a single-GPU test skipped on the GPU (CUDA not seen?)" if unexpected_skips else ""), counts


def run_pytest_cuda(ctx: StageContext) -> Outcome:
    junit, log_path = ctx.out_dir / "pytest_cuda.xml", ctx.out_dir / "pytest_cuda.log"
    command = python_module("pytest", "-m", "cuda", "-q", "-rfE", "-p", "no:cacheprovider")
    command += ["-p", "kvserve.gpu_check.pytest_check", f"--junitxml={junit}"]
    cuda = ctx.sizes.device == "cuda"
    workers = WORKERS if cuda and importlib.util.find_spec("xdist") is not None else 1
    command += ["-n", str(workers)] if workers > 1 else []
    env = {k: v for k, v in os.environ.items() if not (cuda and k == "TRITON_INTERPRET")}
    with log_path.open("w") as log:
        run = subprocess.run(command, check=False, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
    ids = _outcomes(ctx)
    ok, summary, counts = _verdict(ids, cuda)
    figures: dict[str, Any] = {"exit_code": run.returncode, "workers": workers, "log": str(log_path), "tail": tail}
    figures.update(counts, failing=ids.get("failed", [])[:20], skipped_multi_gpu_tests=ids.get("skipped_multi_gpu", []))
    ok = ok and run.returncode == 0
    error = None if ok else "\n".join([*figures["failing"], *tail])
    return Outcome(ok, f"{summary} (exit {run.returncode})", figures, error=error)


def tiny_models_result(ctx: StageContext) -> Outcome:
    """test_tiny_models.py's CUDA cases in that run: tiny Llama/Mistral/Qwen2 and a SmolLM2-135M-shaped
    model in float32, both attention backends, logits within 2e-4 of transformers'."""
    cases = {k: [n for n in v if n.startswith(TINY_MODELS)] for k, v in _outcomes(ctx).items()}
    ok, summary, counts = _verdict(cases, ctx.sizes.device == "cuda")
    ok = ok and any(cases.values())  # the module ran (on CPU its CUDA cases are skipped)
    error = None if ok else "\n".join(cases.get("failed") or cases.get("skipped") or ["no test_tiny_models result"])
    return Outcome(ok, f"test_tiny_models.py on CUDA: {summary}", {**counts, "tests": cases}, error=error)
