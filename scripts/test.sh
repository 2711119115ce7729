#!/usr/bin/env bash
# The full test run: lint, types, fast CPU tests, then e2e against a real local control plane.
# Called by `./dev test` and by .ci/run. Set KVPILOT_SKIP_E2E=1 to run only the fast part.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== ruff"
ruff check .
ruff format --check .

echo "== mypy"
bash scripts/mypy.sh

echo "== unit tests (CPU)"
python -m pytest tests -q -p no:cacheprovider

if [ "${KVPILOT_SKIP_E2E:-0}" != "1" ] && [ -d e2e ] && ls e2e/test_*.py >/dev/null 2>&1; then
  echo "== e2e (local Kubernetes control plane)"
  python -m pytest e2e -q -p no:cacheprovider
fi
