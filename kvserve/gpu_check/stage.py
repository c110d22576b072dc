"""A stage process: its checks in order, each in a try/except under its own time limit.

`python -m kvserve.gpu_check.stage NAME --out ... --work ... --deadline EPOCH` (the
orchestrator starts it). A check that raises, or runs past its limit (SIGALRM, so a check
stuck in Python is stopped; one stuck inside CUDA is ended by the orchestrator killing the
stage), is recorded as FAIL with the error text and the next one runs. A CUDA fault poisons
the process, so after one the remaining checks of the stage fail at once, naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.gpu_check.orchestrator import pids_file
from kvserve.gpu_check.registry import CheckSpec, checks_of
from kvserve.gpu_check.results import FAIL, PASS, CheckResult, Outcome, read_result, write_result
from kvserve.gpu_check.scale import Scale, scale_for
from kvserve.gpu_check.wheel_list import REPO_ROOT

_CUDA_FAULTS = ("CUDA error", "illegal memory access", "device-side assert", "CUBLAS_STATUS", "cudaError")


class CheckTimeout(BaseException):
    """Raised in the check by SIGALRM; a BaseException so a check's own `except Exception` cannot swallow it."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def expire(_signum: int, _frame: Any) -> None:
        raise CheckTimeout(f"ran past its time limit of {seconds:.0f}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class ResourceFailed(RuntimeError):
    """A shared resource (a model, a server) failed to start for an earlier check of the stage."""


@dataclass
class CheckContext:
    """What a check gets: where to write, the sizes to run at, and the stage's shared resources."""

    out_dir: Path
    work_dir: Path
    wheels_dir: Path
    mode: str
    scale: Scale
    stage: str
    deadline: float
    repo: Path = REPO_ROOT
    state: dict[str, Any] = field(default_factory=dict)
    """Figures one check leaves for a later one of the same stage (the copy bandwidth, the undisturbed streams)."""
    _resources: dict[str, Any] = field(default_factory=dict)
    _cleanups: list[Callable[[], None]] = field(default_factory=list)

    def resource(self, key: str, factory: Callable[[], Any], close: Callable[[Any], None] | None = None) -> Any:
        """Made once per stage by the first check that asks; its failure is remembered for the others."""
        if key not in self._resources:
            try:
                value = factory()
            except Exception as exc:
                self._resources[key] = ResourceFailed(f"{key} failed to start: {type(exc).__name__}: {exc}")
                raise
            self._resources[key] = value
            if close is not None:
                self._cleanups.append(lambda: close(value))
        value = self._resources[key]
        if isinstance(value, ResourceFailed):
            raise value
        return value

    def release(self, key: str, close: Callable[[Any], None]) -> None:
        """Close a resource early (the GPU memory it holds is wanted by the next check)."""
        value = self._resources.pop(key, None)
        if value is not None and not isinstance(value, ResourceFailed):
            close(value)

    def on_close(self, fn: Callable[[], None]) -> None:
        self._cleanups.append(fn)

    def remember_process_group(self, pgid: int) -> None:
        """A process group to kill if this stage is killed before it could stop it itself."""
        with open(pids_file(self.work_dir, self.stage), "a") as f:
            f.write(f"{pgid}\n")

    def close(self) -> None:
        while self._cleanups:
            fn = self._cleanups.pop()
            try:
                fn()
            except Exception as exc:
                print(f"[gpu_check stage {self.stage}] cleanup failed: {exc}", flush=True)


def _say(stage: str, message: str) -> None:
    print(f"[gpu_check stage {stage}] {message}", flush=True)


def _unmet_needs(spec: CheckSpec, out_dir: Path) -> list[str]:
    unmet = []
    for name in spec.needs:
        found = read_result(out_dir, name)
        if found is None or found.status != PASS:
            unmet.append(name)
    return unmet


def run_check(spec: CheckSpec, ctx: CheckContext, poisoned: list[str]) -> CheckResult:
    """Run one check and write its result; `poisoned` carries a CUDA fault from an earlier check."""
    result = CheckResult(spec.name, spec.kind, spec.stage, FAIL, "", spec.time_limit_s)
    started = time.time()
    limit = min(spec.time_limit_s * ctx.scale.limit_factor, ctx.deadline - started - 5)
    unmet = _unmet_needs(spec, ctx.out_dir)
    if poisoned:
        result.error = f"not run: an earlier check of stage {spec.stage} hit a CUDA fault: {poisoned[0]}"
    elif unmet:
        result.error = f"not run: needs {', '.join(unmet)}, which did not pass"
    elif limit < 2:
        result.error = f"not run: stage {spec.stage} has no time left"
    else:
        _say(spec.stage, f"{spec.name} starts (limit {limit:.0f}s)")
        try:
            with time_limit(limit):
                fn = getattr(importlib.import_module(spec.module), spec.function)
                outcome: Outcome = fn(ctx)
            result.status = PASS if outcome.passed else FAIL
            result.summary = outcome.summary
            result.figures = outcome.figures
            result.rows = [list(row) for row in outcome.rows]
            result.error = outcome.error
        except CheckTimeout as exc:
            result.error = str(exc)
        except Exception as exc:
            text = "".join(traceback.format_exception(exc)[-6:]).strip()
            result.error = f"{type(exc).__name__}: {exc}\n{text}"
            if any(marker in str(exc) for marker in _CUDA_FAULTS):
                poisoned.append(f"{type(exc).__name__}: {exc}"[:300])
    result.duration_s = round(time.time() - started, 2)
    if result.status == FAIL and not result.summary:
        result.summary = (result.error or "failed").splitlines()[0][:200]
    write_result(ctx.out_dir, result)
    _say(spec.stage, f"{spec.name}: {result.status} in {result.duration_s:.1f}s: {result.summary}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvserve.gpu_check.stage")
    parser.add_argument("stage")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--wheels", type=Path, required=True)
    parser.add_argument("--mode", default="gpu")
    parser.add_argument("--deadline", type=float, required=True)
    args = parser.parse_args(argv)
    scale = scale_for(args.mode)
    if scale.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels run through the interpreter
    from kvserve.log_config import configure_logging

    configure_logging(json=True, process=f"gpu_check-{args.stage}")
    ctx = CheckContext(args.out, args.work, args.wheels, args.mode, scale, args.stage, args.deadline)
    poisoned: list[str] = []
    try:
        results = [run_check(spec, ctx, poisoned) for spec in checks_of(args.stage)]
    finally:
        ctx.close()
    return 0 if all(r.status == PASS for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
