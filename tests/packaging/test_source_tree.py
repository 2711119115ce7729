"""Running Python from the checkout's root must not shadow the standard library.

The repository root holds the folder ``operator/`` (the package ``kvpilot.operator``). With the root
on ``sys.path`` (``python -m ...`` or ``python -c`` run there, as ``./dev`` does on a fresh machine)
the import system also sees it as the top-level ``operator``; a fresh CI run failed exactly there
(``cannot import name 'eq' from 'operator'``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv",
    [
        # runpy -> importlib.util -> contextlib -> collections -> operator
        ["-m", "timeit", "-n", "1", "pass"],
        ["-c", "import collections, operator; assert operator.eq(1, 1) and operator.itemgetter(0)([5]) == 5"],
        ["-S", "-c", "import operator; assert operator.attrgetter('real')(3) == 3"],
    ],
)
def test_stdlib_operator_wins_at_the_repo_root(argv: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_every_top_level_folder_with_python_is_not_a_stdlib_name() -> None:
    shadowing = sorted(
        p.name
        for p in ROOT.iterdir()
        if (p / "__init__.py").is_file() and p.name in sys.stdlib_module_names and p.name != "operator"
    )
    assert not shadowing, f"top-level folders named like standard-library modules: {shadowing}"


def test_kvpilot_operator_is_still_the_operator_package() -> None:
    import kvpilot.operator

    assert kvpilot.operator.__name__ == "kvpilot.operator"
    assert not hasattr(kvpilot.operator, "itemgetter")


def test_kvpilot_links_every_part_for_static_tools() -> None:
    """kvpilot/<part> links to each top-level part that pyproject maps to kvpilot.<part>, so mypy (and
    any tool that does not run the editable install's finder) sees the package as it is installed."""
    import tomllib

    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    parts = {
        name.split(".", 1)[1]: folder for name, folder in package_dir.items() if name.startswith("kvpilot.")
    }
    assert parts, package_dir
    for part, folder in parts.items():
        link = ROOT / "kvpilot" / part
        assert link.is_symlink(), f"kvpilot/{part} should be a link to ../{folder}"
        assert link.readlink() == Path("..") / folder, (part, link.readlink())
    links = {p.name for p in (ROOT / "kvpilot").iterdir() if p.is_symlink()}
    assert links == set(parts), f"links without a package-dir entry: {sorted(links - set(parts))}"
