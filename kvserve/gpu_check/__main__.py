"""scripts/gpu_check.sh's entry: exit 0 if no check failed, 1 if one did, 2 on usage; stdlib (stages import torch)."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from kvserve.gpu_check.report import FAIL, build_report, markdown, write_json
from kvserve.gpu_check.sizes import GPU, SIZES
from kvserve.gpu_check.stage import dry_run_results, progress, run_stages
from kvserve.gpu_check.wheel_install import install_wheels
from kvserve.gpu_check.wheel_list import DEFAULT_FOLDER, REPO_ROOT, check_folder, read_list


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)  # a usage error exits 2 here, before anything is written
    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out_dir / "results", ignore_errors=True)  # an earlier run's results must not leak in
    with teed(out_dir / "gpu_check.log"):
        try:
            return run(args, out_dir)
        except Exception:
            traceback.print_exc()  # into the log, before the tee ends
            return 1


@contextlib.contextmanager
def teed(log_path: Path) -> Iterator[None]:
    """This process's stdout and stderr, and its children's, through `tee log_path` (as `2>&1 | tee`)."""
    tee = subprocess.Popen(["tee", str(log_path)], stdin=subprocess.PIPE)
    assert tee.stdin is not None
    for fd in (1, 2):
        os.dup2(tee.stdin.fileno(), fd)
    tee.stdin.close()
    try:
        yield
    finally:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            stream.flush()
            os.dup2(devnull, fd)
        tee.wait(timeout=30)


def run(args: argparse.Namespace, out_dir: Path) -> int:
    started, mode = time.time(), "dry-run" if args.dry_run else "cpu-rehearsal" if args.cpu_rehearsal else "gpu"
    sizes = SIZES.get(mode, GPU)  # the dry run runs nothing
    budget_s = args.budget_s or sizes.budget_s
    progress(f"mode {mode}, repository {REPO_ROOT}, python {sys.executable}")
    work, wheels_dir = args.work.resolve(), args.wheels.resolve()
    folder = check_folder(wheels_dir, read_list())
    progress(f"wheels: {folder.status}, {len(folder.present)}/{folder.listed} present")
    for message in folder.messages:
        progress(f"  wheels: {message}")
    env, install, site = dict(os.environ), "skipped", None
    if mode == "gpu":  # the rehearsal and the dry run use this machine's own packages
        install, site = install_wheels(args.wheels, args.site), str(args.site)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
        progress(f"wheels installed into {site}: {install}")
    results = dry_run_results() if mode == "dry-run" else run_stages(out_dir, work, wheels_dir, sizes, budget_s, env)
    wheels = {**asdict(folder), "site": site, "install": install}
    report = build_report(mode, started, time.time(), budget_s, wheels, results)
    path = write_json(out_dir / "report.json", report)
    print("\n" + markdown(results, mode) + "\n", flush=True)
    s = report["summary"]
    progress(f"report: {path} ({s['passed']} passed, {s['failed']} failed, {s['not_implemented']} not implemented)")
    failed = any(r.status == FAIL for r in results)
    return 1 if failed or (mode == "dry-run" and folder.status == "fail") else 0


if __name__ == "__main__":
    sys.exit(main())
