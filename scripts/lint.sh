#!/usr/bin/env bash
# The habits every change keeps: lint, formatting, types, import rules, no dead code (`make lint`; `make test` runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
"$BIN/ruff" check .
"$BIN/ruff" format --check .
"$BIN/mypy"
"$BIN/lint-imports" --no-cache
"$BIN/vulture"  # paths, exclusions and the whitelist: [tool.vulture] in pyproject.toml
