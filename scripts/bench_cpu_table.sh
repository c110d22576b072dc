#!/usr/bin/env bash
# Issue 12's CPU table in one run, on one machine, on the same SmolLM2 Q4_1 GGUF:
#   1. llama.cpp's llama-batched-bench: decode at B=1/8/32/64 and prefill, pp 128 / tg 64;
#   2. `kvserve bench executor` for each --dtype/--weights, the same shapes (128-token contexts,
#      prefill of 8 x 128 tokens), the median step of each; the first is the default (`auto`/`auto`),
#      whose figures the goal verdicts judge;
#   3. `kvserve bench serve --workload mixed` over HTTP for each configuration, the first one also
#      against llama-server (--target) and HF transformers generate (--baselines hf);
#   4. a single stream: `bench serve --concurrency 1`, kvserve's default configuration against
#      llama-server with one slot (output tok/s, ITL p50 and p99);
#   and the bytes a llama.cpp decode step reads of the GGUF, for B=1 against the physical limit.
# Then `python -m kvserve.bench.cpu_table OUT_DIR` prints the markdown table and the goal ratios.
# Needs scripts/build_llama_server.sh first. About 25 minutes on 2 cores; run it on a quiet machine.
#
#   scripts/bench_cpu_table.sh [OUT_DIR]        # default: bench-cpu/ (git-ignored)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$here/.venv/bin/python}"
out="${1:-$here/bench-cpu}"
bin="$here/.llama.cpp/build/bin"
threads="${THREADS:-2}"
mkdir -p "$out"
cd "$here"

gguf="$("$python" -c 'from kvserve.executor.weights.model_store import default_model_source as d; s = d(); print(s.path / s.gguf_file)')"
lscpu > "$out/lscpu.txt"
git rev-parse --short HEAD > "$out/commit.txt" 2>/dev/null || true

"$python" -m kvserve.bench.physical_limit "$gguf" --context 128 > "$out/llama-bytes.json"

echo "[1/4] llama-batched-bench (pp 128, tg 64, B = 1 8 32 64)"
/usr/bin/time -f "%M" -o "$out/llama-batched.rss_kib" \
    "$bin/llama-batched-bench" -m "$gguf" -c 16384 -b 2048 -ub 512 -npp 128 -ntg 64 -npl 1,8,32,64 \
    -t "$threads" --output-format jsonl 2>"$out/llama-batched.log" | grep '^{' > "$out/llama-batched.jsonl"

configs=(auto/auto float32/dequantized float32/native)
# bfloat16 only where the CPU multiplies it natively: elsewhere every bf16 op is emulated (a decode
# step at batch 8 measured 4x slower than fp32) and its executor bench alone runs past 15 minutes.
if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then configs+=(bfloat16/dequantized); fi
echo "[2/4] kvserve bench executor (${configs[*]})"
for config in "${configs[@]}"; do
    "$python" -m kvserve bench executor --dtype "${config%/*}" --weights "${config#*/}" --num-threads "$threads" \
        --batches 1 8 32 64 --prompt-len 128 --steps 16 --prefill-len 128 --prefill-batches 8 \
        --json > "$out/executor-${config/\//-}.json"
    echo "  $config done"
done

echo "[3/4] kvserve bench serve --workload mixed (llama-server and HF generate with the first)"
serve=(--workload mixed --num-requests 32 --concurrency 16 --max-tokens-cap 64 --start-server --executor torch
       --api openai --no-progress)
llama_log="$out/llama-server.log"
bash scripts/llama_server.sh 0 > "$llama_log" 2>&1 &
llama_pid=$!
trap 'kill "$llama_pid" 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    target="$(head -n 1 "$llama_log" 2>/dev/null || true)"
    if [[ "$target" == llama-server=* ]] && curl -sf "${target#llama-server=}/health" > /dev/null; then break; fi
    sleep 1
done
for config in "${configs[@]}"; do
    extra=()
    if [[ "$config" == float32/dequantized ]]; then extra=(--target "$target" --baselines hf); fi
    "$python" -m kvserve bench serve "${serve[@]}" "${extra[@]}" \
        --server-arg="--dtype=${config%/*}" --server-arg="--weights=${config#*/}" \
        --json "$out/serve-${config/\//-}.json" > "$out/serve-${config/\//-}.log" 2>&1
    echo "  $config done"
done
server_pid="$(pgrep -P "$llama_pid" llama-server || echo "$llama_pid")"
awk '/VmHWM/ {print $2}' "/proc/$server_pid/status" > "$out/llama-server.rss_kib" 2>/dev/null || true
kill "$llama_pid" 2>/dev/null || true
wait "$llama_pid" 2>/dev/null || true

echo "[4/4] a single stream: kvserve's default configuration against llama-server with one slot"
SLOTS=1 CTX_PER_SLOT=2048 bash scripts/llama_server.sh 0 > "$llama_log" 2>&1 &
llama_pid=$!
for _ in $(seq 120); do
    target="$(head -n 1 "$llama_log" 2>/dev/null || true)"
    if [[ "$target" == llama-server=* ]] && curl -sf "${target#llama-server=}/health" > /dev/null; then break; fi
    sleep 1
done
"$python" -m kvserve bench serve --workload mixed --num-requests 8 --concurrency 1 --max-tokens-cap 128 \
    --start-server --executor torch --api openai --no-progress --target "$target" \
    --json "$out/serve-single.json" > "$out/serve-single.log" 2>&1
echo "  single stream done"

"$python" -m kvserve.bench.cpu_table "$out" | tee "$out/table.md"
