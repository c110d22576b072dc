#!/usr/bin/env bash
# Debian's Chromium, which the web page's browser tests (tests/ui) drive through Playwright.
# Idempotent: does nothing when `chromium` is on PATH. Used by `make test` and `make test-fast`.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    SUDO=(sudo)
fi
echo ">> installing Chromium from Debian's packages (for the web page's browser tests; once)"
export DEBIAN_FRONTEND=noninteractive
if ! "${SUDO[@]}" apt-get install -y -q chromium >/dev/null; then
    "${SUDO[@]}" apt-get update -q >/dev/null
    "${SUDO[@]}" apt-get install -y -q chromium >/dev/null
fi
command -v chromium >/dev/null
