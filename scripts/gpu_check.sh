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
# kvserve is not pip-installed on the GPU machine: it runs from the checkout, through a folder that
# holds only a `kvserve` link. The checkout's root itself on PYTHONPATH would let its `kernels/`
# shadow Hugging Face's `kernels` package, which transformers imports (kvserve/child_python.py).
import_path="${KVSERVE_GPU_CHECK_WORK:-/tmp/kvserve-gpu-check}/import-path"
mkdir -p "$import_path" && ln -sfn "$REPO/kvserve" "$import_path/kvserve"
export PYTHONPATH="$import_path${PYTHONPATH:+:$PYTHONPATH}" KVSERVE_REPO="$REPO" PYTHONSAFEPATH=1
exec "$PY" -m kvserve.gpu_check "$@"
