#!/usr/bin/env bash
# The GPU proof: check kvserve's CUDA path and measure it, in one run of under 8 minutes on an H200.
#
#   scripts/gpu_check.sh OUT_DIR                  # on the GPU machine (no network needed)
#   scripts/gpu_check.sh --dry-run OUT_DIR        # anywhere: the plumbing only, in seconds
#   scripts/gpu_check.sh OUT_DIR --cpu-rehearsal  # anywhere: every check at toy sizes on CPU
#
# Options come in any order; `python -m kvserve.gpu_check --help` lists them. Writes
# OUT_DIR/report.json and OUT_DIR/gpu_check.log, and prints the markdown tables at the end. Exit
# status: 0 no check failed, 1 something failed, 2 usage. This script only finds the checkout
# and the interpreter; the run itself (installing .gpu-wheels/ on the GPU, the stages, the
# report) is Python's. See docs/gpu_check.md. Environment:
#   PYTHON                  the interpreter (default python3)
#   KVSERVE_GPU_WHEELS      the wheel folder (default .gpu-wheels in the repository)
#   KVSERVE_GPU_SITE        where the wheels are installed (default /tmp/kvserve-gpu-site)
#   KVSERVE_GPU_CHECK_WORK  models and scratch, not returned (default /tmp/kvserve-gpu-check)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$(command -v python3 || command -v python)}
# kvserve is not pip-installed on the GPU machine: it runs from the checkout, with the folders that
# hold the package's portions on PYTHONPATH (the editable install's list, pyproject.toml's dev-mode-dirs).
# Without a pyproject.toml (scripts/ copied alone), the installed kvserve is the one in reach.
if [ -f "$REPO/pyproject.toml" ]; then
    import_path=$("$PY" -c 'import sys, tomllib; t = tomllib.load(open(sys.argv[1], "rb"))
print(":".join(sys.argv[2] + "/" + d for d in t["tool"]["hatch"]["build"]["targets"]["wheel"]["dev-mode-dirs"]))' \
        "$REPO/pyproject.toml" "$REPO")
    export PYTHONPATH="$import_path${PYTHONPATH:+:$PYTHONPATH}"
fi
export KVSERVE_REPO="$REPO"
exec "$PY" -m kvserve.gpu_check "$@"
