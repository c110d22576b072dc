"""What a check gets and gives, its result file (written as it ends: a dying stage keeps it) and report.json."""

from __future__ import annotations

import contextlib
import json
import math
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvserve.gpu_check.sizes import Sizes
from kvserve.gpu_check.stages import MEASUREMENT

SCHEMA = "kvserve-gpu-check/1"
PASS, FAIL = "PASS", "FAIL"
SKIP_DRY_RUN = "SKIP (dry run)"
NOT_IMPLEMENTED = "NOT IMPLEMENTED"  # a measurement of something kvserve lacks yet: reported, never a pass
MEASUREMENT_HEADER = ("measurement", "setting", "value", "fraction", "goal")
COUNTED = {"passed": PASS, "failed": FAIL, "skipped": SKIP_DRY_RUN, "not_implemented": NOT_IMPLEMENTED}


@dataclass
class StageContext:
    """What a check gets: where to write, the sizes, and what the stage's checks share."""

    out_dir: Path
    work_dir: Path
    wheels_dir: Path
    sizes: Sizes
    pgids_file: Path  # the stage's servers' process groups, for the parent to kill if the stage dies first
    budget_s: float
    state: dict[str, Any] = field(default_factory=dict)  # shared things, figures one check leaves for a later one
    closing: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def shared(self, key: str, make: Callable[[], Any], close: str | None = "close") -> Any:
        """Made by the first check that asks, its `close` method called at stage end; a failure is kept for all."""
        if key not in self.state:
            try:
                self.state[key] = make()
                self.closing.callback(getattr(self.state[key], close)) if close else None
            except Exception as exc:
                self.state[key] = RuntimeError(f"{key} failed to start: {type(exc).__name__}: {exc}")
        if isinstance(self.state[key], RuntimeError):
            raise self.state[key]
        return self.state[key]

    def remember_process_groups(self, *pgids: int) -> None:
        with self.pgids_file.open("a") as f:
            f.writelines(f"{pgid}\n" for pgid in pgids)


@dataclass(slots=True)
class Outcome:
    """What a check function returns; `rows` are its lines of the measurement table (MEASUREMENT_HEADER's)."""

    passed: bool
    summary: str
    figures: dict[str, Any] = field(default_factory=dict)
    rows: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    error: str | None = None


def judged(summary: str, figures: dict[str, Any], problems: list[str], rows: list[Any] | None = None) -> Outcome:
    """PASS when nothing went wrong; else FAIL, with the first problem in the summary and all in the error."""
    summary += f"; {problems[0]}" if problems else ""
    return Outcome(not problems, summary, figures, rows or [], error="\n".join(problems) or None)


@dataclass(slots=True)
class CheckResult:
    name: str
    kind: str
    stage: str
    status: str
    summary: str
    time_limit_s: float  # the budget of the stage it ran in (a check has no limit of its own)
    duration_s: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    rows: list[list[str]] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return finite(asdict(self))


def finite(value: Any) -> Any:
    """NaN and inf become None, tuples lists, so the JSON is strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """Written whole or not at all (a stage may be killed mid-write): a temporary file renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(data, indent=2, allow_nan=False, default=str) + "\n")
    return path.with_suffix(".tmp").replace(path)


def write_result(out_dir: Path, result: CheckResult) -> None:
    write_json(out_dir / "results" / f"{result.name}.json", result.to_dict())


def read_result(out_dir: Path, name: str) -> CheckResult | None:
    try:
        return CheckResult(**json.loads((out_dir / "results" / f"{name}.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _table(header: tuple[str, ...], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows])


def markdown(results: list[CheckResult], mode: str) -> str:
    env = next((r.figures for r in results if r.name == "environment"), {})
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "triton", "transformers", "cuda") if env.get(k))
    title = f"GPU check ({mode}): {env.get('device_name') or 'no GPU'}" + (f"; {versions}" if versions else "")
    checks = [[r.name, r.kind, r.status, r.summary] for r in results]
    measured: list[list[str]] = []
    for r in (r for r in results if r.kind == MEASUREMENT):
        placeholder = {SKIP_DRY_RUN: "dry run", NOT_IMPLEMENTED: "not implemented"}.get(r.status, "not measured")
        measured += [list(row) for row in r.rows] or [[r.name, "-", placeholder, "-", "-"]]
    tables = [_table(("check", "kind", "status", "result"), checks), _table(MEASUREMENT_HEADER, measured)]
    return "\n\n".join([f"**{title}**", *tables])


def build_report(
    mode: str, started: float, finished: float, budget_s: float, wheels: dict[str, Any], results: list[CheckResult]
) -> dict[str, Any]:
    iso = [datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds") for t in (started, finished)]
    report: dict[str, Any] = dict(schema=SCHEMA, mode=mode, started_at=iso[0], finished_at=iso[1])
    host = {"python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine()}
    report.update(duration_s=round(finished - started, 1), time_budget_s=budget_s, command=sys.argv, host=host)
    counts = {key: sum(r.status == status for r in results) for key, status in COUNTED.items()}
    summary = {"total": len(results), **counts, "failed_checks": [r.name for r in results if r.status == FAIL]}
    checks = [r.to_dict() for r in results]
    report.update(wheels=wheels, checks=checks, summary=summary, markdown=markdown(results, mode))
    return finite(report)
