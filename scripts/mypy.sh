#!/usr/bin/env bash
# Type-check the kvpilot package. kvpilot/<part> are checked-in links to the top-level folders, so
# mypy follows the package from the repository root like any other tool ([tool.mypy] packages).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m mypy --config-file pyproject.toml "$@"
