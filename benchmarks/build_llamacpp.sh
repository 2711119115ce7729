#!/usr/bin/env bash
# Build llama.cpp's llama-server from the sources vendored in the llama-cpp-python sdist on PyPI.
# The binary is cached in benchmarks/.build/llama.cpp-<version>/bin/llama-server (gitignored), so
# later runs reuse it. Usage: benchmarks/build_llamacpp.sh [llama-cpp-python version]
# Runs at low priority (nice 10) because it takes a while on a 2-core machine.
set -euo pipefail
VERSION="${1:-0.3.36}"
HERE="$(cd "$(dirname "$0")" && pwd)"
BUILD="$HERE/.build"
OUT="$BUILD/llama.cpp-$VERSION"
if [[ -x "$OUT/bin/llama-server" ]]; then
  echo "$OUT/bin/llama-server"
  exit 0
fi
PIP="${PIP:-python -m pip}"
mkdir -p "$BUILD/src"
SDIST="$BUILD/src/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
  $PIP download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$BUILD/src"
fi
SRC="$BUILD/src/llama_cpp_python-$VERSION"
[[ -d "$SRC" ]] || tar -xzf "$SDIST" -C "$BUILD/src"
nice -n 10 cmake -S "$SRC/vendor/llama.cpp" -B "$OUT/cmake" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
nice -n 10 cmake --build "$OUT/cmake" --config Release -j2 --target llama-server
mkdir -p "$OUT/bin"
cp "$OUT/cmake/bin/llama-server" "$OUT/bin/llama-server"
echo "$OUT/bin/llama-server"
