#!/usr/bin/env bash
# The GPU proof: check kvserve's CUDA path and measure it, in one run of under 8 minutes on an H200.
#
#   scripts/gpu_check.sh OUT_DIR              # on the GPU machine (no network needed)
#   scripts/gpu_check.sh OUT_DIR --dry-run    # anywhere: the plumbing only, in seconds
#
# Writes OUT_DIR/report.json (every check PASS/FAIL with its figures, every measurement) and
# OUT_DIR/gpu_check.log (this script's whole output), and prints a markdown table of the
# measurements for docs/benchmarks.md. Exit status: 0 all passed, 1 something failed, 2 usage.
#
# On the GPU machine the wheels in .gpu-wheels/ (scripts/gpu_wheels.sh fills it) are installed
# into a folder of their own and put first on PYTHONPATH, then the repository root (kvserve is
# not pip-installed there; its CLI is `python -m kvserve`). Models are built there from real
# configs with random weights: nothing is downloaded. See docs/gpu_check.md. Environment:
#   PYTHON                  the interpreter (default python3)
#   KVSERVE_GPU_WHEELS      the wheel folder (default .gpu-wheels in the repository)
#   KVSERVE_GPU_SITE        where the wheels are installed (default /tmp/kvserve-gpu-site)
#   KVSERVE_GPU_CHECK_WORK  models and scratch, not returned (default /tmp/kvserve-gpu-check)
set -uo pipefail

usage() {
    echo "usage: scripts/gpu_check.sh OUT_DIR [--dry-run] [--budget-s SECONDS]" >&2
    echo "  writes OUT_DIR/report.json and OUT_DIR/gpu_check.log; --dry-run checks the plumbing only" >&2
    exit 2
}

[ $# -ge 1 ] || usage
case "$1" in
    -h | --help) usage ;;
    -*) echo "gpu_check.sh: OUT_DIR must come first, got option $1" >&2; usage ;;
esac
OUT_DIR=$1
shift
INSTALL_WHEELS=1  # not for --dry-run, nor for --cpu-rehearsal (it runs on this machine's own packages)
for arg in "$@"; do
    case "$arg" in
        --dry-run | --cpu-rehearsal) INSTALL_WHEELS=0 ;;
        --budget-s | --budget-s=* | [0-9]*) ;;
        *) echo "gpu_check.sh: unknown argument $arg" >&2; usage ;;
    esac
done

REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$(command -v python3 || command -v python)}
WHEELS=${KVSERVE_GPU_WHEELS:-$REPO/.gpu-wheels}
mkdir -p "$OUT_DIR" || exit 2
OUT_DIR=$(cd "$OUT_DIR" && pwd)

run() {
    echo "gpu_check.sh: $(date -u +%Y-%m-%dT%H:%M:%SZ) repository $REPO, python $PY"
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" KVSERVE_REPO="$REPO"
    local install=skipped site=""
    if [ "$INSTALL_WHEELS" -eq 1 ]; then
        site=${KVSERVE_GPU_SITE:-/tmp/kvserve-gpu-site}
        if compgen -G "$WHEELS/*.whl" >/dev/null; then
            rm -rf "$site"
            local started=$SECONDS
            if "$PY" -m pip --version >/dev/null 2>&1; then
                if timeout 180 "$PY" -m pip install --disable-pip-version-check --no-index --no-deps --quiet \
                    --target "$site" "$WHEELS"/*.whl; then
                    install=pip
                else
                    install="pip failed"
                fi
            elif "$PY" -m kvserve.gpu_check.wheel_list install --target "$site" "$WHEELS"/*.whl; then
                install=unzip  # no pip on the image: a wheel is a zip of its files
            else
                install="unzip failed"
            fi
            echo "gpu_check.sh: wheels installed into $site ($install, $((SECONDS - started))s)"
            export PYTHONPATH="$site:$PYTHONPATH"
        else
            echo "gpu_check.sh: no wheels in $WHEELS; running on the image's packages alone"
            install="no wheels"
        fi
    fi
    "$PY" -m kvserve.gpu_check "$OUT_DIR" "$@" --wheels "$WHEELS" ${site:+--site "$site"} --install "$install"
}

run "$@" 2>&1 | tee "$OUT_DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
