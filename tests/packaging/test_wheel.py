"""The wheel carries the same import layout as the editable install (folders -> kvpilot.<part>)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"
]


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    # Built from a copy of what the wheel is made of: setuptools reuses an in-tree build/ directory,
    # whose stale copies of modules would hide a package missing from pyproject's list.
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    for folder in set(PACKAGE_DIR.values()):
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(ROOT / folder, source / folder, symlinks=True, ignore=ignore)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(work),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = work.glob("kvpilot-*.whl")
    target = work / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    return target


def run_in(target: Path, code: str) -> str:
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    # cwd: not the repository, whose kvpilot/ folder would otherwise be imported instead
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=target, check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


def test_parts_import_from_the_wheel(installed_wheel: Path) -> None:
    code = (
        "import kvpilot, kvpilot.runtime.config, kvpilot.api.models, kvpilot.autoscaler.policy, kvpilot.router.policy, "
        "kvpilot.kernels.quant, kvpilot.runtime.models.llama, kvpilot.kernels.cpu_attention as c;"
        "print(kvpilot.__file__); print(c.SOURCE.exists())"
    )
    path, source_exists = run_in(installed_wheel, code).splitlines()
    assert path.startswith(str(installed_wheel)), path
    assert source_exists == "True"  # the CPU kernel's C source ships in the wheel


def test_the_c_extensions_build_from_the_wheel(installed_wheel: Path, tmp_path: Path) -> None:
    """Sources and the headers they include ship, and compile where the wheel is installed."""
    code = (
        "import os; os.environ['KVPILOT_KERNEL_CACHE'] = os.environ['CACHE'];"
        "from kvpilot.kernels import cpu_attention, cpu_ops;"
        "print(cpu_attention.available(), cpu_ops.available())"
    )
    env = {"PYTHONPATH": str(installed_wheel), "PATH": "/usr/bin:/bin", "CACHE": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=installed_wheel, check=True, capture_output=True, text=True
    )
    assert out.stdout.split() == ["True", "True"], out.stderr
    assert sorted(p.name.split("-")[0] for p in tmp_path.glob("*.so")) == ["cpu_ops", "paged_attention_cpu"]


def test_every_file_of_the_source_tree_is_in_the_wheel(installed_wheel: Path) -> None:
    """A subpackage missing from pyproject's `packages` list builds and installs without a word and
    fails at import: kvpilot.runtime.engine.kv_transfer (P/D disaggregation) was missing, so every
    non-editable install, the runtime image included, died at `kvpilot serve` with ModuleNotFoundError.
    Data files (the kernels' C sources, py.typed) are checked the same way."""
    missing = []
    for package, folder in PACKAGE_DIR.items():
        src, dest = ROOT / folder, installed_wheel / Path(*package.split("."))
        # kvpilot/ holds links to the parts, which are packages of their own
        files = src.glob("*") if package == "kvpilot" else src.rglob("*")
        for f in files:
            if f.is_symlink() or not f.is_file() or "__pycache__" in f.parts or f.suffix == ".pyc":
                continue
            if not (dest / f.relative_to(src)).is_file():
                missing.append(f"{folder}/{f.relative_to(src)}")
    assert not missing, (
        f"not in the wheel (add its package to pyproject's `packages`, a data file to `package-data`): {missing}"
    )


def test_no_bare_top_level_packages(installed_wheel: Path) -> None:
    names = {
        p.name
        for p in installed_wheel.iterdir()
        if p.is_dir() and not p.name.endswith(".dist-info") and p.name != "bin"
    }
    assert names == {"kvpilot"}, names  # nothing shadows `operator` or claims `runtime`


def test_cli_entry_point_from_the_wheel(installed_wheel: Path) -> None:
    out = run_in(installed_wheel, "from kvpilot.cli import main; import sys; sys.argv=['kvpilot']; main([])")
    assert "serve" in out and "operator" in out and "autoscaler" in out
