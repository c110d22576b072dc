"""`python -m kvserve.gpu_check OUT_DIR [--dry-run | --cpu-rehearsal]`, what scripts/gpu_check.sh runs.

Options come in any order (argparse). Exit status: 0 when no check failed, 1 otherwise, 2 for a
usage error. Stdlib and `packaging` only: the stages import torch in their own processes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from kvserve.gpu_check.report import FAIL, build_report, markdown, write_report
from kvserve.gpu_check.sizes import sizes_for
from kvserve.gpu_check.stage import dry_run_results, progress, run_stages
from kvserve.gpu_check.wheel_install import install_wheels
from kvserve.gpu_check.wheel_list import DEFAULT_FOLDER, REPO_ROOT, check_folder, read_list


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="scripts/gpu_check.sh",
        usage="%(prog)s OUT_DIR [--dry-run | --cpu-rehearsal] [--budget-s SECONDS] [options]",
        description="Check kvserve's CUDA path and measure it; writes OUT_DIR/report.json (docs/gpu_check.md).",
    )
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="where report.json and the logs go")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="check the plumbing only (any machine, seconds)")
    mode.add_argument("--cpu-rehearsal", action="store_true", help="every check at toy sizes on CPU (minutes)")
    parser.add_argument("--budget-s", type=float, help="time budget of the whole run (default: 460 on the GPU)")
    parser.add_argument("--wheels", type=Path, default=Path(env("KVSERVE_GPU_WHEELS") or DEFAULT_FOLDER))
    parser.add_argument("--site", type=Path, default=Path(env("KVSERVE_GPU_SITE") or "/tmp/kvserve-gpu-site"))
    parser.add_argument("--work", type=Path, default=Path(env("KVSERVE_GPU_CHECK_WORK") or "/tmp/kvserve-gpu-check"))
    return parser.parse_args(argv)


def tee_output(log_path: Path) -> subprocess.Popen:
    """This process's stdout and stderr, and its children's, through `tee log_path` (as `2>&1 | tee`)."""
    tee = subprocess.Popen(["tee", str(log_path)], stdin=subprocess.PIPE)
    assert tee.stdin is not None
    os.dup2(tee.stdin.fileno(), 1)
    os.dup2(tee.stdin.fileno(), 2)
    tee.stdin.close()
    return tee


def end_tee(tee: subprocess.Popen) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    tee.wait(timeout=30)


def run(args: argparse.Namespace, out_dir: Path) -> int:
    started = time.time()
    mode = "dry-run" if args.dry_run else "cpu-rehearsal" if args.cpu_rehearsal else "gpu"
    sizes = sizes_for(mode)
    budget_s = args.budget_s or sizes.budget_s
    progress(f"mode {mode}, repository {REPO_ROOT}, python {sys.executable}")
    folder = check_folder(args.wheels.resolve(), read_list())
    progress(f"wheels: {folder.status}, {len(folder.present)}/{folder.listed} present")
    for message in folder.messages:
        progress(f"  wheels: {message}")
    env, install, site = dict(os.environ), "skipped", None
    if mode == "gpu":  # the rehearsal and the dry run use this machine's own packages
        install, site = install_wheels(args.wheels, args.site), str(args.site)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
        progress(f"wheels installed into {site}: {install}")
    if mode == "dry-run":
        results = dry_run_results()
    else:
        results = run_stages(out_dir, args.work.resolve(), args.wheels.resolve(), sizes, budget_s, env)
    wheels = {**asdict(folder), "site": site, "install": install}
    report = build_report(mode, started, time.time(), budget_s, wheels, results)
    path = write_report(out_dir, report)
    print("\n" + markdown(results, mode) + "\n", flush=True)
    s = report["summary"]
    progress(f"report: {path} ({s['passed']} passed, {s['failed']} failed, {s['not_implemented']} not implemented)")
    failed = any(r.status == FAIL for r in results)
    return 1 if failed or (mode == "dry-run" and folder.status == "fail") else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # a usage error exits 2 here, before anything is written
    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out_dir / "results", ignore_errors=True)  # an earlier run's results must not leak in
    tee = tee_output(out_dir / "gpu_check.log")
    try:
        return run(args, out_dir)
    except Exception:
        traceback.print_exc()  # into the log, before the tee ends
        return 1
    finally:
        end_tee(tee)


if __name__ == "__main__":
    sys.exit(main())
