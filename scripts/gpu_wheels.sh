#!/usr/bin/env bash
# Fill .gpu-wheels/ with what scripts/gpu_check.sh needs on a GPU machine that has no network.
#
#   scripts/gpu_wheels.sh            # download what is missing, drop wheels no longer listed
#
# The wheels are the Python 3.12 manylinux x86_64 builds of every entry of scripts/gpu_wheels.txt
# (the GPU image already has CUDA, torch, triton and transformers). Beside them goes the default
# model's tokenizer, from kvserve's own model cache (~/.cache/kvserve, or $KVSERVE_CACHE),
# converted first if it is not there yet, so the random-weight models built on the GPU get a
# real tokenizer. The folder is git-ignored; carry it with the checkout to the GPU machine.
# It ends by checking the folder and printing its size against what may travel (64 MiB, with
# the tracked files). manylinux_2_31 is there for llguidance, whose current wheels need glibc 2.31
# (the real run checks the image's glibc against the newest tag in the folder). Environment:
#   PYTHON              the interpreter whose pip downloads (default .venv/bin/python, else python3)
#   KVSERVE_GPU_WHEELS  the folder (default .gpu-wheels)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=${KVSERVE_GPU_WHEELS:-.gpu-wheels}
mkdir -p "$DEST"

mapfile -t SPECS < <("$PY" -m kvserve.gpu_check.wheel_list specs)
echo ">> downloading ${#SPECS[@]} wheels for CPython 3.12 manylinux x86_64 into $DEST"
"$PY" -m pip download --disable-pip-version-check --quiet \
    --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 \
    --implementation cp --no-deps -d "$DEST" "${SPECS[@]}"

CACHE=${KVSERVE_CACHE:-$HOME/.cache/kvserve}
MODEL="$CACHE/models/smollm2-135m-instruct"
if [ ! -f "$MODEL/tokenizer.json" ]; then
    echo ">> converting the default model once, for its tokenizer files"
    "$PY" -c "from kvserve.executor.weights.model_store import ensure_model_dir; ensure_model_dir()"
fi
TOKENIZER="$DEST/smollm2-tokenizer"
mkdir -p "$TOKENIZER"
for name in tokenizer.json tokenizer_config.json special_tokens_map.json config.json \
    generation_config.json chat_template.jinja; do
    if [ -f "$MODEL/$name" ]; then
        cp "$MODEL/$name" "$TOKENIZER/$name"
    fi
done
echo ">> tokenizer files: $(cd "$TOKENIZER" && ls | tr '\n' ' ')"

"$PY" -m kvserve.gpu_check.wheel_list prune "$DEST"
