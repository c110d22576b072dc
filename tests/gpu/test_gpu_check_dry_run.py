"""`scripts/gpu_check.sh OUT_DIR --dry-run`: the GPU proof's plumbing, checked here on CPU in seconds.

The script is run as a person runs it (bash, a subprocess), against wheel folders built for
each case: none (a clean checkout: a warning, exit 0), complete, and one wheel short (exit 1,
the wheel named). The report must have the real run's schema and name every check, skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.gpu_check.wheel_list import TOKENIZER_DIR, TOKENIZER_REQUIRED, read_list

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
EXPECTED_CHECKS = {
    "environment": "check",
    "pytest_cuda": "check",
    "runner_vs_hf_tiny": "check",
    "build_models": "check",
    "runner_vs_hf_8b_logits": "check",
    "device_peaks": "measurement",
    "decode_attention_bandwidth": "measurement",
    "kv_sizing": "check",
    "decode_throughput": "measurement",
    "prefill_throughput": "measurement",
    "cuda_graphs_compile": "measurement",
    "bench_serve_vs_hf": "measurement",
    "serve_64_streams": "check",
    "serve_kill9": "check",
}
REPORT_KEYS = [
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
]
CHECK_KEYS = {"name", "kind", "stage", "status", "summary", "time_limit_s", "duration_s", "figures", "rows", "error"}


def run_script(*args: str, wheels: Path | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    if wheels is not None:
        env["KVSERVE_GPU_WHEELS"] = str(wheels)
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO
    )


def fake_wheels(folder: Path, *, leave_out: str | None = None) -> None:
    """Empty files named like the listed wheels (the dry run checks names and tags), plus the tokenizer."""
    folder.mkdir()
    for req in read_list():
        if req.name != leave_out:
            (folder / f"{req.name.replace('-', '_')}-{req.version}-py3-none-any.whl").write_bytes(b"")
    (folder / TOKENIZER_DIR).mkdir()
    for name in TOKENIZER_REQUIRED:
        (folder / TOKENIZER_DIR / name).write_text("{}")


def report_of(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def test_dry_run_writes_the_real_schema_with_every_check_skipped(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_script(str(out), "--dry-run", wheels=tmp_path / "no-such-folder")
    assert done.returncode == 0, done.stdout + done.stderr
    report = report_of(out)
    assert list(report) == REPORT_KEYS
    assert report["schema"] == "kvserve-gpu-check/1" and report["mode"] == "dry-run"
    checks = report["checks"]
    assert [c["name"] for c in checks] == list(EXPECTED_CHECKS)
    for check in checks:
        assert set(check) == CHECK_KEYS, check["name"]
        assert check["kind"] == EXPECTED_CHECKS[check["name"]]
        assert check["status"] == "SKIP (dry run)", (check["name"], check["error"])
        assert check["time_limit_s"] > 0 and check["summary"]
    assert report["time_budget_s"] < 8 * 60, "the run must fit twice into 15 minutes of device time"
    assert report["summary"] == {
        "total": 14,
        "passed": 0,
        "failed": 0,
        "skipped": 14,
        "not_implemented": 0,
        "failed_checks": [],
    }
    # a clean checkout has no wheel folder: a warning, not a failure
    assert report["wheels"]["status"] == "warning" and not report["wheels"]["exists"]
    assert "scripts/gpu_wheels.sh" in " ".join(report["wheels"]["messages"])
    # the markdown tables, in the report and in the log
    log = (out / "gpu_check.log").read_text()
    for text in (report["markdown"], log):
        assert "| check | kind | status | result |" in text
        assert "| measurement | setting | value | fraction | goal |" in text
        assert "| serve_kill9 | check | SKIP (dry run) |" in text
        assert "| cuda_graphs_compile | measurement | SKIP (dry run) |" in text
    assert "report: " in log and done.stdout == log


def test_complete_wheel_folder_passes(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    fake_wheels(wheels)
    done = run_script(str(tmp_path / "out"), "--dry-run", wheels=wheels)
    assert done.returncode == 0, done.stdout + done.stderr
    found = report_of(tmp_path / "out")["wheels"]
    assert found["status"] == "ok" and found["missing"] == [] and len(found["present"]) == len(read_list())


def test_a_missing_wheel_fails_the_dry_run_and_is_named(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    fake_wheels(wheels, leave_out="pyzmq")
    done = run_script(str(tmp_path / "out"), "--dry-run", wheels=wheels)
    assert done.returncode == 1
    found = report_of(tmp_path / "out")["wheels"]
    pin = next(r.spec for r in read_list() if r.name == "pyzmq")
    assert found["status"] == "fail" and found["missing"] == [pin]
    assert f"missing wheels: {pin}" in done.stdout


def test_a_wheel_for_another_python_is_not_accepted(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    fake_wheels(wheels, leave_out="grpcio")
    version = next(r.version for r in read_list() if r.name == "grpcio")
    (wheels / f"grpcio-{version}-cp311-cp311-manylinux_2_17_x86_64.whl").write_bytes(b"")
    done = run_script(str(tmp_path / "out"), "--dry-run", wheels=wheels)
    assert done.returncode == 1
    assert report_of(tmp_path / "out")["wheels"]["not_installable"] == [
        f"grpcio-{version}-cp311-cp311-manylinux_2_17_x86_64.whl"
    ]


@pytest.mark.skipif(not (REPO / ".gpu-wheels").is_dir(), reason="no .gpu-wheels/ (scripts/gpu_wheels.sh fills it)")
def test_the_filled_wheel_folder_passes(tmp_path: Path) -> None:
    done = run_script(str(tmp_path / "out"), "--dry-run", wheels=REPO / ".gpu-wheels")
    assert done.returncode == 0, done.stdout
    found = report_of(tmp_path / "out")["wheels"]
    assert found["status"] == "ok" and found["size_mib"] < 60 and found["unlisted"] == []


def test_missing_out_dir_is_a_usage_error(tmp_path: Path) -> None:
    done = run_script()
    assert done.returncode == 2
    assert done.stderr.startswith("usage: scripts/gpu_check.sh OUT_DIR")


def test_options_come_in_any_order(tmp_path: Path) -> None:
    done = run_script("--dry-run", str(tmp_path / "out"), "--budget-s", "100", wheels=tmp_path / "no-such-folder")
    assert done.returncode == 0, done.stdout + done.stderr
    report = report_of(tmp_path / "out")
    assert report["mode"] == "dry-run" and report["time_budget_s"] == 100


@pytest.mark.parametrize(
    "args",
    [["--dry-run"], ["OUT", "--bogus"], ["OUT", "--dry-run", "--cpu-rehearsal"]],
    ids=["no-out", "unknown", "two-modes"],
)
def test_bad_arguments_are_usage_errors(tmp_path: Path, args: list[str]) -> None:
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    done = run_script(*args)
    assert done.returncode == 2 and "usage: scripts/gpu_check.sh" in done.stderr
    assert not (tmp_path / "out" / "report.json").exists()
