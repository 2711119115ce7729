#!/usr/bin/env bash
# mypy cannot follow the editable install's folder -> kvpilot.<part> mapping, so check the
# packages through a throwaway tree of symlinks that has the import layout.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir -p "$tree/kvpilot"
for f in kvpilot/*.py kvpilot/py.typed; do ln -s "$root/$f" "$tree/kvpilot/$(basename "$f")"; done
for part in api kube runtime kernels operator autoscaler router; do ln -s "$root/$part" "$tree/kvpilot/$part"; done
cd "$tree"
python -m mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" -p kvpilot
