"""`scripts/gpu_check.sh OUT --cpu-rehearsal`: every stage of the GPU check, end to end on CPU at toy sizes.

The figures mean nothing on CPU; what is checked is that every stage runs in its process, every
check ends PASS (CUDA graphs rehearsed on the Triton interpreter, none captured), and the report is the
GPU run's. Without a carried tokenizer the default model's is used, so this needs the default model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.gpu_check.stages import CHECKS

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def test_the_cpu_rehearsal_runs_every_check(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "KVSERVE_GPU_WHEELS": str(tmp_path / "no-wheels")}
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu-rehearsal", str(out), "--work", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=2300,
        env=env,
        cwd=REPO,
    )
    report = json.loads((out / "report.json").read_text())
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    failed = {c["name"]: c["error"] for c in report["checks"] if c["status"] != "PASS"}
    assert report["mode"] == "cpu-rehearsal" and list(statuses) == [c.name for c in CHECKS]
    assert set(statuses.values()) == {"PASS"}, failed
    assert done.returncode == 0, done.stdout[-3000:]
    assert report["summary"]["failed"] == 0 and report["summary"]["not_implemented"] == 0
    assert (out / "results" / "serve_kill9.json").is_file() and (out / "bench_serve_mixed.json").is_file()
    assert (
        "rehearsed without capture"
        in report["checks"][[c.name for c in CHECKS].index("cuda_graphs_compile")]["summary"]
    )
    assert "| bench_serve_vs_hf |" in report["markdown"] and done.stdout == (out / "gpu_check.log").read_text()
