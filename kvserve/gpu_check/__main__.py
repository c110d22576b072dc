"""`python -m kvserve.gpu_check OUT_DIR [--dry-run]`: what scripts/gpu_check.sh runs after installing the wheels.

Exit status: 0 when every check passed (dry run: when the plumbing is sound), 1 otherwise,
2 for a usage error. Standard library only until a stage process starts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from kvserve.gpu_check.orchestrator import Orchestrator, dry_run_results, progress
from kvserve.gpu_check.report import build_report, markdown, ordered, write_report
from kvserve.gpu_check.results import FAIL, PASS
from kvserve.gpu_check.wheel_list import DEFAULT_FOLDER, check_folder, read_list, tracked_files_mib

DEFAULT_BUDGET_S = 460.0
"""The whole run must end within 8 minutes on an H200 so that it fits twice in 15 minutes of device time."""
DEFAULT_WORK_DIR = Path(os.environ.get("KVSERVE_GPU_CHECK_WORK") or "/tmp/kvserve-gpu-check")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu_check.sh",
        description="Check kvserve's CUDA path and measure it; writes OUT_DIR/report.json (docs/gpu_check.md).",
    )
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="where report.json and the logs go")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="check the plumbing only (any machine, seconds)")
    mode.add_argument(
        "--cpu-rehearsal",
        action="store_true",
        help="run every check that can run without a GPU at toy sizes on CPU (development; minutes)",
    )
    parser.add_argument("--wheels", type=Path, default=DEFAULT_FOLDER, help="the carried wheel folder")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK_DIR, help="models and scratch (not returned)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="time budget of the whole run")
    parser.add_argument("--site", default=None, help="where gpu_check.sh installed the wheels (recorded)")
    parser.add_argument("--install", default="skipped", help="how gpu_check.sh installed them (recorded)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    mode = "dry-run" if args.dry_run else "cpu-rehearsal" if args.cpu_rehearsal else "gpu"
    out_dir: Path = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out_dir / "results", ignore_errors=True)  # an earlier run's results must not leak in

    folder = check_folder(args.wheels, read_list())
    folder.tracked_mib = tracked_files_mib()
    wheels = {**folder.to_dict(), "site": args.site, "install": args.install}
    progress(started, f"mode {mode}; wheels: {folder.status}, {len(folder.present)}/{folder.listed} present")
    for message in folder.messages:
        progress(started, f"  wheels: {message}")

    if mode == "dry-run":
        results = dry_run_results()
    else:
        results = Orchestrator(out_dir, args.work.resolve(), args.wheels.resolve(), mode, args.budget_s).run()
    listed = ordered(results)
    report = build_report(
        mode=mode,
        started=started,
        finished=time.time(),
        budget_s=args.budget_s,
        command=sys.argv,
        wheels=wheels,
        results=listed,
    )
    path = write_report(out_dir, report)
    env = next((r.figures for r in listed if r.name == "environment"), None)
    print("\n" + markdown(listed, mode, env) + "\n", flush=True)
    summary = report["summary"]
    progress(
        started,
        f"report: {path} ({summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped)",
    )
    if mode == "dry-run":
        return 1 if summary["failed"] or folder.status == "fail" else 0
    return 0 if all(r.status == PASS for r in listed) and not any(r.status == FAIL for r in listed) else 1


if __name__ == "__main__":
    sys.exit(main())
