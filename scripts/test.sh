#!/usr/bin/env bash
# `make test` and `make test-fast`: set-up, lint and the tests, each timed, then one table of the
# three against the suite's 30-minute goal. Arguments go to pytest. Used by .ci/run through `make test`.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
GOAL_S=1800
PHASES=()

timed() {
    local name=$1 started rc
    shift
    started=$(date +%s)
    "$@"
    rc=$?
    PHASES+=("$name $(($(date +%s) - started))")
    return "$rc"
}

report() {
    local total=0 line
    echo "== time by phase =="
    for line in "${PHASES[@]}"; do
        printf '  %-8s %6s s\n' ${line}
        total=$((total + ${line##* }))
    done
    printf '  %-8s %6s s  (%d%% of the %d s goal)\n' total "$total" $((100 * total / GOAL_S)) "$GOAL_S"
}
trap report EXIT

timed setup scripts/setup.sh || exit
timed browser scripts/setup_browser.sh || exit
timed lint scripts/lint.sh || exit
timed tests "$VENV/bin/python" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit "$rc"
