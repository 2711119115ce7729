"""torch & co. are pyproject's `runtime` extra: the operator image installs kvpilot without it.

`kvpilot serve` without the extra fails with a message naming it; the control plane's commands still
parse and load (run in a subprocess where importing torch fails, as in the operator image).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NO_TORCH = (
    "import sys; sys.modules['torch'] = None; from kvpilot.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _kvpilot_without_torch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_serve_without_the_runtime_extra_names_it() -> None:
    result = _kvpilot_without_torch("serve", "--help")
    assert result.returncode == 2, result.stderr
    assert "pip install 'kvpilot[runtime]'" in result.stderr
    assert "torch is not installed" in result.stderr


def test_control_plane_commands_load_without_torch() -> None:
    for command in ("operator", "router", "autoscaler"):
        result = _kvpilot_without_torch(command, "--help")
        assert result.returncode == 0, (command, result.stderr[-2000:])


def test_torch_is_only_in_the_runtime_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].split("[")[0] for d in project["dependencies"]}
    assert "torch" not in names
    assert any(d.startswith("torch") for d in project["optional-dependencies"]["runtime"])
    assert "kvpilot[runtime]" in project["optional-dependencies"]["test"]
