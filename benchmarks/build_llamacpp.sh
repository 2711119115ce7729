#!/usr/bin/env bash
# Build llama.cpp's llama-server from the sources vendored in the llama-cpp-python sdist on PyPI.
#
# Usage: benchmarks/build_llamacpp.sh [--isa native|avx2|avx512] [--target llama-server|llama-quantize]
#                                    [llama-cpp-python version]
#
#   --isa native  (default) GGML_NATIVE=ON: every instruction set this CPU has (AVX-512, AMX, ...).
#                 Cached in <build>/llama.cpp-<version>/bin/llama-server.
#   --isa avx2    GGML_NATIVE=OFF with only AVX, AVX2, FMA, F16C and BMI2 (no AVX-512, no AVX-VNNI,
#                 no AVX512-VNNI/BF16, no AMX): the llama-server an AVX2-only CPU gets, for the fair
#                 AVX2 comparison (runtime_vs_peers.py suite) on an AVX-512 machine. Cached in
#                 <build>/llama.cpp-<version>-avx2/bin/llama-server.
#   --isa avx512  GGML_NATIVE=OFF with AVX2 and AVX-512 F/CD/VL/DQ/BW only (no VNNI, no BF16, no VBMI,
#                 no AMX): the llama-server of a Skylake-SP Xeon, the peer for kvpilot under the
#                 "AVX-512 without BF16/VNNI" emulation (KVPILOT_CPU_HIDE_FEATURES, as scripts/test.sh
#                 sets it). Cached in <build>/llama.cpp-<version>-avx512/bin/llama-server.
#   --target      the binary to build (default llama-server); llama-quantize (used by
#                 benchmarks/peers/shapes.py for Q4_K_M files) lands next to it in bin/. Each is built
#                 only when missing; a second target reuses the first one's objects (same cmake folder).
#
# <build> is benchmarks/.build (gitignored) unless LLAMACPP_BUILD_DIR names another folder.
# The avx2 binary is verified after the build: `objdump -d` of it must not mention a single zmm
# register or an AVX-512 opmask register ({%k1}..{%k7}); the script fails otherwise. The same check
# by hand:  objdump -d --no-show-raw-insn <binary> | grep -c zmm   (must print 0).
# The avx512 binary likewise must not mention vpdpbusd, vpdpwssd, vdpbf16ps, vcvtne(2)ps2bf16 or an AMX
# tile dot product (tdpb*).
# Runs at low priority (nice, NICE=10 by default) because it takes ~10 minutes on a 2-core machine.
set -euo pipefail
ISA=native
TARGET=llama-server
VERSION=0.3.36
while [[ $# -gt 0 ]]; do
  case "$1" in
    --isa) ISA="${2:?--isa needs native, avx2 or avx512}"; shift 2 ;;
    --isa=*) ISA="${1#--isa=}"; shift ;;
    --target) TARGET="${2:?--target needs a binary name}"; shift 2 ;;
    --target=*) TARGET="${1#--target=}"; shift ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    -*) echo "build_llamacpp.sh: unknown option $1" >&2; exit 2 ;;
    *) VERSION="$1"; shift ;;
  esac
done
HERE="$(cd "$(dirname "$0")" && pwd)"
BUILD="${LLAMACPP_BUILD_DIR:-$HERE/.build}"
NICE="${NICE:-10}"
# the emulated builds: AVX2 and its companions, no VNNI, BF16, VBMI or AMX; AVX-512 F/CD/VL/DQ/BW per level
FIXED_FLAGS=(-DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF
  -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
  -DGGML_AVX_VNNI=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
  -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
case "$ISA" in
  native)
    OUT="$BUILD/llama.cpp-$VERSION"
    ISA_FLAGS=(-DGGML_NATIVE=ON)
    ;;
  avx2)
    OUT="$BUILD/llama.cpp-$VERSION-avx2"
    ISA_FLAGS=("${FIXED_FLAGS[@]}" -DGGML_AVX512=OFF)
    ;;
  avx512)
    OUT="$BUILD/llama.cpp-$VERSION-avx512"
    ISA_FLAGS=("${FIXED_FLAGS[@]}" -DGGML_AVX512=ON)
    ;;
  *) echo "build_llamacpp.sh: --isa must be native, avx2 or avx512, not '$ISA'" >&2; exit 2 ;;
esac
case "$TARGET" in
  llama-server|llama-quantize) ;;
  *) echo "build_llamacpp.sh: --target must be llama-server or llama-quantize, not '$TARGET'" >&2; exit 2 ;;
esac

# fails unless no line of the binary's disassembly matches the extended regex: forbid BINARY REGEX WHAT WHY
forbid() {
  local n
  n="$(objdump -d --no-show-raw-insn "$1" | grep -cE "$2" || true)"
  if [[ "$n" != 0 ]]; then
    echo "build_llamacpp.sh: $1 has $n $3 instructions; $4" >&2
    exit 1
  fi
  echo "verified: objdump -d $1 has no $3 instructions" >&2
}

verify() {
  case "$ISA" in
    avx2) forbid "$1" '%zmm[0-9]|\{%k[1-7]\}' "AVX-512 (zmm/opmask)" "not an AVX2-only build" ;;
    avx512) forbid "$1" 'vpdpbusd|vpdpwssd|vdpbf16ps|vcvtne2ps2bf16|vcvtneps2bf16|tdpb' "VNNI/BF16/AMX" \
      "not a Skylake-class build" ;;
  esac
}

if [[ -x "$OUT/bin/$TARGET" ]]; then
  verify "$OUT/bin/$TARGET"
  echo "$OUT/bin/$TARGET"
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
nice -n "$NICE" cmake -S "$SRC/vendor/llama.cpp" -B "$OUT/cmake" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON "${ISA_FLAGS[@]}" -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
nice -n "$NICE" cmake --build "$OUT/cmake" --config Release -j2 --target "$TARGET"
mkdir -p "$OUT/bin"
cp "$OUT/cmake/bin/$TARGET" "$OUT/bin/$TARGET"
verify "$OUT/bin/$TARGET"
echo "$OUT/bin/$TARGET"
