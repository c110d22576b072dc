"""Each check's result (a file written the moment it ends, so a stage that dies keeps what it finished),
and `OUT_DIR/report.json` with the markdown tables, in one schema for every mode. Standard library only.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvserve.gpu_check.stages import MEASUREMENT

SCHEMA = "kvserve-gpu-check/1"
MEASUREMENT_HEADER = ("measurement", "setting", "value", "fraction", "goal")
PASS = "PASS"
FAIL = "FAIL"
SKIP_DRY_RUN = "SKIP (dry run)"
NOT_IMPLEMENTED = "NOT IMPLEMENTED"
"""A measurement of something kvserve does not have yet: reported, never counted as a pass."""


@dataclass(slots=True)
class Outcome:
    """What a check function returns; `rows` are its lines of the measurement table
    (what, setting, value, fraction, goal)."""

    passed: bool
    summary: str
    figures: dict[str, Any] = field(default_factory=dict)
    rows: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    error: str | None = None


@dataclass(slots=True)
class CheckResult:
    name: str
    kind: str
    stage: str
    status: str
    summary: str
    time_limit_s: float
    """The budget of the stage it ran in (a check has no limit of its own)."""
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


def write_result(out_dir: Path, result: CheckResult) -> None:
    _write_json(out_dir / "results" / f"{result.name}.json", result.to_dict())


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Written whole or not at all (a stage may be killed mid-write): a temporary file renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(data, indent=2, allow_nan=False, default=str) + "\n")
    path.with_suffix(".tmp").replace(path)


def read_result(out_dir: Path, name: str) -> CheckResult | None:
    try:
        return CheckResult(**json.loads((out_dir / "results" / f"{name}.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


def summarize(results: list[CheckResult]) -> dict[str, Any]:
    count = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIP_DRY_RUN, NOT_IMPLEMENTED)}
    counts = dict(
        passed=count[PASS], failed=count[FAIL], skipped=count[SKIP_DRY_RUN], not_implemented=count[NOT_IMPLEMENTED]
    )
    return {"total": len(results), **counts, "failed_checks": [r.name for r in results if r.status == FAIL]}


def _table(header: tuple[str, ...], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows])


def markdown(results: list[CheckResult], mode: str) -> str:
    """A title naming the device and versions, the checks table and the measurements table."""
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
    return finite(
        {
            "schema": SCHEMA,
            "mode": mode,
            "started_at": _iso(started),
            "finished_at": _iso(finished),
            "duration_s": round(finished - started, 1),
            "time_budget_s": budget_s,
            "command": sys.argv,
            "host": {"python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine()},
            "wheels": wheels,
            "checks": [r.to_dict() for r in results],
            "summary": summarize(results),
            "markdown": markdown(results, mode),
        }
    )


def write_report(out_dir: Path, report: dict[str, Any]) -> Path:
    _write_json(out_dir / "report.json", report)
    return out_dir / "report.json"
