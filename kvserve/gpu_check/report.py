"""`OUT_DIR/report.json` and the markdown tables printed at the end of a run.

The schema is the same for the dry run and the real run (only `mode` and the statuses differ),
so whatever reads the real report can be tried on a dry-run one. The measurement table is
written to be pasted into docs/benchmarks.md. Standard library only.
"""

from __future__ import annotations

import json
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvserve.gpu_check.registry import CHECKS, MEASUREMENT
from kvserve.gpu_check.results import FAIL, PASS, SKIP_DRY_RUN, CheckResult, finite

SCHEMA = "kvserve-gpu-check/1"
MODES = ("dry-run", "gpu", "cpu-rehearsal")
REPORT_KEYS = (
    "schema",
    "mode",
    "started_at",
    "finished_at",
    "duration_s",
    "time_budget_s",
    "command",
    "host",
    "wheels",
    "checks",
    "summary",
    "markdown",
)
MEASUREMENT_HEADER = ("measurement", "setting", "value", "fraction", "goal")


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


def host_facts() -> dict[str, Any]:
    return {"python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine()}


def summarize(results: list[CheckResult]) -> dict[str, Any]:
    counts = {status: sum(r.status == status for r in results) for status in (PASS, FAIL, SKIP_DRY_RUN)}
    return {
        "total": len(results),
        "passed": counts[PASS],
        "failed": counts[FAIL],
        "skipped": counts[SKIP_DRY_RUN],
        "failed_checks": [r.name for r in results if r.status == FAIL],
    }


def _table(header: tuple[str, ...], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def checks_table(results: list[CheckResult]) -> str:
    return _table(("check", "kind", "status", "result"), [[r.name, r.kind, r.status, r.summary] for r in results])


def measurement_table(results: list[CheckResult]) -> str:
    """The measurements' rows; one placeholder row for a measurement that has none."""
    rows: list[list[str]] = []
    for r in results:
        if r.kind != MEASUREMENT:
            continue
        if r.rows:
            rows += [list(row) for row in r.rows]
        else:
            rows.append([r.name, "-", "not measured" if r.status != SKIP_DRY_RUN else "dry run", "-", "-"])
    return _table(MEASUREMENT_HEADER, rows)


def markdown(results: list[CheckResult], mode: str, environment: dict[str, Any] | None) -> str:
    env = environment or {}
    device = env.get("device_name") or "no GPU"
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "triton", "transformers", "cuda") if env.get(k))
    title = f"GPU check ({mode}): {device}" + (f"; {versions}" if versions else "")
    return "\n\n".join([f"**{title}**", checks_table(results), measurement_table(results)])


def build_report(
    *,
    mode: str,
    started: float,
    finished: float,
    budget_s: float,
    command: list[str],
    wheels: dict[str, Any],
    results: list[CheckResult],
) -> dict[str, Any]:
    env_result = next((r for r in results if r.name == "environment"), None)
    environment = env_result.figures if env_result is not None else None
    report = {
        "schema": SCHEMA,
        "mode": mode,
        "started_at": iso(started),
        "finished_at": iso(finished),
        "duration_s": round(finished - started, 1),
        "time_budget_s": budget_s,
        "command": command,
        "host": host_facts(),
        "wheels": wheels,
        "checks": [r.to_dict() for r in results],
        "summary": summarize(results),
        "markdown": markdown(results, mode, environment),
    }
    assert tuple(report) == REPORT_KEYS
    return finite(report)


def write_report(out_dir: Path, report: dict[str, Any]) -> Path:
    path = out_dir / "report.json"
    path.write_text(json.dumps(report, indent=2, allow_nan=False, default=str) + "\n")
    return path


def ordered(results: dict[str, CheckResult]) -> list[CheckResult]:
    """Results in registry order (every registered check must have one)."""
    return [results[c.name] for c in CHECKS]
