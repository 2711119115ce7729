#!/usr/bin/env bash
# Installs the load tools benchmarks/load_tools_bench.py drives, each in its own cached virtual
# environment (never into the project's):
#   inference-perf 0.7.0  (kubernetes-sigs; needs Python >= 3.12, no torch)
#       -> $KVPILOT_LOAD_TOOLS_DIR/inference-perf/bin/inference-perf
#   guidellm 0.8.1        (needs torch: its environment borrows the project environment's torch and
#                          transformers through a .pth file placed last on its path, so nothing of
#                          several GB is downloaded again; what guidellm pins differently (click, ...)
#                          is installed into its own environment, which shadows the project's)
#       -> $KVPILOT_LOAD_TOOLS_DIR/guidellm/bin/guidellm
# KVPILOT_LOAD_TOOLS_DIR defaults to ${XDG_CACHE_HOME:-~/.cache}/kvpilot-load-tools.
#
# Run it with the project's environment active (PYTHON=... to name its python instead):
#   bash scripts/load_tools.sh        # prints where each tool is; exit 0 when both are there
# Idempotent: quick and offline when both are installed at the pinned versions.
# Python >= 3.12 for inference-perf: $PYTHON312, else python3.13/python3.12 on PATH, else pyenv's.
set -euo pipefail

INFERENCE_PERF="inference-perf==0.7.0"
GUIDELLM="guidellm==0.8.1"
TOOLS_DIR="${KVPILOT_LOAD_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpilot-load-tools}"
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
status=0

log() { echo "load-tools: $*" >&2; }

# has VENV SPEC: the venv's python sees the pinned version of SPEC's package
has() {
  [ -x "$1/bin/python" ] && "$1/bin/python" - "$2" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

name, _, want = sys.argv[1].partition("==")
try:
    sys.exit(0 if version(name) == want else 1)
except PackageNotFoundError:
    sys.exit(1)
EOF
}

python312() {
  if [ -n "${PYTHON312:-}" ]; then echo "$PYTHON312"; return; fi
  local p
  for p in python3.13 python3.12; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import venv' 2>/dev/null; then command -v "$p"; return; fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for p in "$(pyenv root)"/versions/3.1[23]*/bin/python3.1[23]; do
      if [ -x "$p" ]; then echo "$p"; return; fi
    done
  fi
  return 1
}

install_inference_perf() {
  local venv="$TOOLS_DIR/inference-perf"
  if ! has "$venv" "$INFERENCE_PERF"; then
    local py
    if ! py="$(python312)"; then
      log "inference-perf needs Python >= 3.12: none found (set PYTHON312, or apt-get install python3.12/3.13)"
      return 1
    fi
    log "installing $INFERENCE_PERF into $venv (with $py) ..."
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q "$INFERENCE_PERF"
  fi
  log "inference-perf $("$venv/bin/python" -c 'from importlib.metadata import version; print(version("inference-perf"))')  $venv/bin/inference-perf"
}

install_guidellm() {
  local venv="$TOOLS_DIR/guidellm"
  if ! has "$venv" "$GUIDELLM"; then
    local base site
    base="$("$PY" -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')"
    site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    if ! "$PY" -c 'import torch, transformers' 2>/dev/null; then
      log "guidellm borrows torch and transformers from $PY's environment, which has none (activate the project's)"
      return 1
    fi
    log "installing $GUIDELLM into $venv (torch from $site) ..."
    rm -rf "$venv"
    "$base" -m venv "$venv"
    local own
    own="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # zz_: read after the environment's own packages, so its pins shadow the project's
    echo "$site" >"$own/zz_kvpilot_project.pth"
    # pip sees the project's packages as installed; what it must change it installs here
    # ("outside environment": it never uninstalls from the project's)
    "$venv/bin/python" -m pip install -q "$GUIDELLM"
  fi
  log "guidellm $("$venv/bin/python" -c 'from importlib.metadata import version; print(version("guidellm"))')  $venv/bin/guidellm"
}

mkdir -p "$TOOLS_DIR"
install_inference_perf || status=1
install_guidellm || status=1
exit "$status"
