"""Each stage in a subprocess of its own, killed past its budget: a CUDA fault poisons a process, a hang never ends."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from kvserve.child_python import python_module
from kvserve.gpu_check import report
from kvserve.gpu_check.report import CheckResult
from kvserve.gpu_check.sizes import SIZES, Sizes
from kvserve.gpu_check.stages import CHECKS, STAGES, Check

BUDGETS = {s.name: s.budget_s for s in STAGES}
CUDA_FAULTS = ("CUDA error", "illegal memory access", "device-side assert", "CUBLAS_STATUS", "cudaError")


def progress(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _pgids(work_dir: Path, stage: str) -> Path:
    return work_dir / f"pgids-{stage}.txt"


def _kill(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def run_stages(out_dir: Path, work: Path, wheels: Path, sizes: Sizes, budget_s: float, env: dict) -> list[CheckResult]:
    work.mkdir(parents=True, exist_ok=True)
    end, why, pending = time.time() + budget_s, {}, []
    for stage in STAGES:
        limit = min(stage.budget_s * sizes.budget_factor, end - time.time())
        if limit < 10:
            why[stage.name] = f"not run: the time budget was spent before stage {stage.name} started"
            continue
        _pgids(work, stage.name).unlink(missing_ok=True)
        checks = ", ".join(c.name for c in CHECKS if c.stage == stage.name)
        progress(f"stage {stage.name} starts, budget {limit:.0f}s: {checks}")
        args = map(str, [stage.name, out_dir, work, wheels, sizes.name, limit])
        stage_env = {**env, **dict(stage.env), "PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        command = python_module("kvserve.gpu_check.stage", *args)
        process = subprocess.Popen(command, env=stage_env, start_new_session=True, stdin=subprocess.DEVNULL)
        pending.append((stage.name, process, time.time() + limit))
        if not stage.beside_next:  # it and those beside it must end before the next stage starts
            why.update(_finish(name, p, deadline, work) for name, p, deadline in pending)
            pending.clear()
    why.update(_finish(name, p, deadline, work) for name, p, deadline in pending)
    results = [report.read_result(out_dir, c.name) for c in CHECKS]
    return [r or _missing(c, why.get(c.stage, "no result"), out_dir) for c, r in zip(CHECKS, results)]


def _finish(stage: str, process: subprocess.Popen, deadline: float, work: Path) -> tuple[str, str]:
    """(stage, why a check of it has no result), once it ended or was killed at its deadline."""
    try:
        how = f"exited with {process.wait(max(0.0, deadline - time.time()))}"
    except subprocess.TimeoutExpired:
        _kill(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
        _kill(process.pid, signal.SIGKILL)
        process.wait()
        how = "ran past its budget and was killed"
    for pgid in _pgids(work, stage).read_text().split() if _pgids(work, stage).is_file() else []:
        _kill(int(pgid), signal.SIGKILL)  # servers it started in sessions of their own
    progress(f"stage {stage} {how}")
    return stage, f"no result: stage {stage} {how} before this check reported"


def _missing(c: Check, why: str, out_dir: Path) -> CheckResult:
    result = CheckResult(c.name, c.kind, c.stage, report.FAIL, why, BUDGETS[c.stage], error=why)
    report.write_result(out_dir, result)
    return result


def check_function(check: Check) -> Callable[[report.StageContext], report.Outcome]:
    module, function = str(check.target).split(":")
    return getattr(importlib.import_module(f"kvserve.gpu_check.{module}"), function)


def dry_run_results() -> list[CheckResult]:
    """Every check SKIP (dry run), or FAIL where its function does not import (torch is imported lazily)."""
    results = []
    for c in CHECKS:
        status = report.SKIP_DRY_RUN if c.target else report.NOT_IMPLEMENTED
        result = CheckResult(c.name, c.kind, c.stage, status, c.about, BUDGETS[c.stage])
        try:
            check_function(c) if c.target else None
        except (ImportError, AttributeError) as exc:
            result.status, result.summary, result.error = report.FAIL, f"{c.target}: {exc}", f"{c.target}: {exc}"
        results.append(result)
    return results


def run_check(check: Check, ctx: report.StageContext, faults: list[str]) -> CheckResult:
    """One check, in a try/except; after a CUDA fault (it poisons the process) the next ones fail at once."""
    result, started = CheckResult(check.name, check.kind, check.stage, report.FAIL, "", ctx.budget_s), time.time()
    if check.target is None:
        result.status, result.summary = report.NOT_IMPLEMENTED, check.about
    elif faults:
        result.error = f"not run: an earlier check of stage {check.stage} hit a CUDA fault: {faults[0]}"
    else:
        progress(f"{check.name} starts")
        try:
            outcome = check_function(check)(ctx)
            result.status = report.PASS if outcome.passed else report.FAIL
            result.summary, result.figures, result.error = outcome.summary, outcome.figures, outcome.error
            result.rows = [list(row) for row in outcome.rows]
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exception(exc)[-6:])
            faults += [f"{type(exc).__name__}: {exc}"[:300]] if any(m in str(exc) for m in CUDA_FAULTS) else []
    result.duration_s = round(time.time() - started, 2)
    result.summary = result.summary or (result.error or "failed").splitlines()[0][:200]
    report.write_result(ctx.out_dir, result)
    progress(f"{check.name}: {result.status} in {result.duration_s:.1f}s: {result.summary}")
    return result


def main(argv: list[str]) -> int:
    """`python -m kvserve.gpu_check.stage STAGE OUT_DIR WORK_DIR WHEELS_DIR SIZES BUDGET_S` (run_stages starts it)."""
    stage, out_dir, work_dir, wheels_dir, sizes_name, budget_s = argv
    sizes = SIZES[sizes_name]
    if sizes.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels run through the interpreter
    from kvserve.log_config import configure_logging

    configure_logging(json=True, process=f"gpu_check-{stage}")
    pgids, budget = _pgids(Path(work_dir), stage), float(budget_s)
    ctx = report.StageContext(Path(out_dir), Path(work_dir), Path(wheels_dir), sizes, pgids, budget)
    faults: list[str] = []
    with ctx.closing:
        results = [run_check(check, ctx, faults) for check in CHECKS if check.stage == stage]
    return 0 if all(r.status != report.FAIL for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
