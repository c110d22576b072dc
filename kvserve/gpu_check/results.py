"""One check's result, as a stage process writes it and the report reads it back.

Each result is its own JSON file under `OUT_DIR/results/`, written the moment the check ends,
so a stage that dies later keeps what it had finished. Standard library only.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PASS = "PASS"
FAIL = "FAIL"
SKIP_DRY_RUN = "SKIP (dry run)"
STATUSES = (PASS, FAIL, SKIP_DRY_RUN)


@dataclass(slots=True)
class Outcome:
    """What a check function returns: whether it passed, its headline and its figures.

    `rows` are the measurement's lines of the markdown table: (what, setting, value, fraction, goal).
    """

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
    duration_s: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    rows: list[list[str]] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return finite(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckResult:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def finite(value: Any) -> Any:
    """NaN and inf become None, tuples lists, so the JSON is strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def result_path(out_dir: Path, name: str) -> Path:
    return out_dir / "results" / f"{name}.json"


def write_result(out_dir: Path, result: CheckResult) -> None:
    path = result_path(out_dir, result.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.to_dict(), indent=2, allow_nan=False, default=str) + "\n")
    tmp.replace(path)


def read_result(out_dir: Path, name: str) -> CheckResult | None:
    path = result_path(out_dir, name)
    if not path.is_file():
        return None
    try:
        return CheckResult.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError):
        return None
