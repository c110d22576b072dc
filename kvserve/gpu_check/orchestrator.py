"""Run the stages one subprocess each, against one time budget, and gather every check's result.

A stage that crashes (a CUDA fault poisons its process), hangs or overruns is killed with its
whole process group; its finished checks keep their results and the others are recorded as
FAIL with the reason, so the report always names every check. A background stage (the CUDA
test suite: mostly CPU-bound kernel compiles) runs beside the next ones, and the first stage
that measures waits for it. Standard library only.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvserve.gpu_check.registry import CHECKS, STAGES, CheckSpec, Stage, checks_of
from kvserve.gpu_check.results import FAIL, SKIP_DRY_RUN, CheckResult, read_result, write_result
from kvserve.gpu_check.scale import scale_for

STAGE_SLACK_S = 30.0
"""A stage may take the sum of its checks' limits plus this (imports, CUDA start-up, teardown)."""
KILL_GRACE_S = 5.0


def progress(started: float, message: str) -> None:
    """A plain progress line (the log is read by people; the stages log structured JSON)."""
    print(f"[gpu_check {time.time() - started:6.1f}s] {message}", flush=True)


def pids_file(work_dir: Path, stage: str) -> Path:
    """Where a stage lists the process groups it started in sessions of their own (servers)."""
    return work_dir / f"pgids-{stage}.txt"


def dry_run_results() -> dict[str, CheckResult]:
    """Every registered check, skipped; FAIL where its `module:function` does not exist."""
    results = {}
    for spec in CHECKS:
        problem = missing_target(spec)
        results[spec.name] = CheckResult(
            name=spec.name,
            kind=spec.kind,
            stage=spec.stage,
            status=FAIL if problem else SKIP_DRY_RUN,
            summary=problem or spec.about,
            time_limit_s=spec.time_limit_s,
            error=problem,
        )
    return results


def missing_target(spec: CheckSpec) -> str | None:
    """Why `spec.target` cannot run, found without importing it (that would import torch), or None."""
    try:
        found = importlib.util.find_spec(spec.module)
    except ImportError as exc:
        return f"{spec.module}: {exc}"
    if found is None or found.origin is None:
        return f"no module {spec.module}"
    tree = ast.parse(Path(found.origin).read_text(encoding="utf-8"))
    names = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    return None if spec.function in names else f"{spec.module} has no function {spec.function}"


@dataclass(slots=True)
class StageRun:
    stage: Stage
    process: subprocess.Popen
    started: float
    limit_s: float

    def wait(self) -> tuple[int | None, bool]:
        """(exit code, timed out), killing the stage's process group when it overruns."""
        remaining = self.started + self.limit_s - time.time()
        try:
            return self.process.wait(timeout=max(0.0, remaining)), False
        except subprocess.TimeoutExpired:
            _kill_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            _kill_group(self.process.pid, signal.SIGKILL)
            self.process.wait()
            return self.process.returncode, True


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Orchestrator:
    """Runs every stage of `STAGES` in order (background ones beside the next) before `deadline`."""

    def __init__(self, out_dir: Path, work_dir: Path, wheels_dir: Path, mode: str, budget_s: float) -> None:
        self.out_dir = out_dir
        self.work_dir = work_dir
        self.wheels_dir = wheels_dir
        self.mode = mode
        self.started = time.time()
        self.deadline = self.started + budget_s
        self.outcomes: dict[str, tuple[int | None, bool]] = {}
        self.not_started: set[str] = set()

    def run(self) -> dict[str, CheckResult]:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        background: dict[str, StageRun] = {}
        for stage in STAGES:
            for name in stage.waits_for:
                if name in background:
                    progress(self.started, f"stage {stage.name} waits for stage {name} to finish")
                    self._finish(background.pop(name))
            run = self._launch(stage)
            if run is None:
                continue
            if stage.background:
                background[stage.name] = run
            else:
                self._finish(run)
        for run in background.values():
            self._finish(run)
        return {spec.name: self._result(spec) for spec in CHECKS}

    def _launch(self, stage: Stage) -> StageRun | None:
        checks = checks_of(stage.name)
        remaining = self.deadline - time.time()
        if remaining < 10:
            progress(self.started, f"stage {stage.name}: not started, the time budget is spent")
            self.not_started.add(stage.name)
            return None
        factor = scale_for(self.mode).limit_factor
        limit = min(sum(c.time_limit_s for c in checks) * factor + STAGE_SLACK_S, remaining)
        command = [
            sys.executable,
            "-m",
            "kvserve.gpu_check.stage",
            stage.name,
            *("--out", str(self.out_dir), "--work", str(self.work_dir), "--wheels", str(self.wheels_dir)),
            *("--mode", self.mode, "--deadline", f"{time.time() + limit:.1f}"),
        ]
        env = {**os.environ, **dict(stage.env), "PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        progress(
            self.started,
            f"stage {stage.name} starts{' in the background' if stage.background else ''}: "
            f"{', '.join(c.name for c in checks)} (limit {limit:.0f}s)",
        )
        process = subprocess.Popen(command, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
        return StageRun(stage, process, time.time(), limit)

    def _finish(self, run: StageRun) -> None:
        code, timed_out = run.wait()
        self.outcomes[run.stage.name] = (code, timed_out)
        for line in _read_lines(pids_file(self.work_dir, run.stage.name)):
            _kill_group(int(line), signal.SIGKILL)  # servers it started in sessions of their own
        how = f"timed out after {run.limit_s:.0f}s and was killed" if timed_out else f"exited with {code}"
        progress(self.started, f"stage {run.stage.name} {how} ({time.time() - run.started:.0f}s)")
        for spec in checks_of(run.stage.name):
            result = read_result(self.out_dir, spec.name)
            line = f"{result.status}: {result.summary}" if result else "no result"
            progress(self.started, f"  {spec.name}: {line}")

    def _result(self, spec: CheckSpec) -> CheckResult:
        found = read_result(self.out_dir, spec.name)
        if found is not None:
            return found
        code, timed_out = self.outcomes.get(spec.stage, (None, False))
        if spec.stage in self.not_started:
            why = f"not run: the time budget was spent before stage {spec.stage} started"
        elif timed_out:
            why = f"not run or not finished: stage {spec.stage} ran past its time limit and was killed"
        else:
            why = f"no result: stage {spec.stage} ended with exit code {code} before this check reported"
        result = CheckResult(spec.name, spec.kind, spec.stage, FAIL, why, spec.time_limit_s, error=why)
        write_result(self.out_dir, result)
        return result


def _read_lines(path: Path) -> list[str]:
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip().isdigit()]
    except OSError:
        return []
