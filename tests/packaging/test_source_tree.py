"""The source tree on its own: running Python from the checkout's root must not shadow the standard
library, and nothing in it may read files from outside the repository.

The repository root holds the folder ``operator/`` (the package ``kvpilot.operator``). With the root
on ``sys.path`` (``python -m ...`` or ``python -c`` run there, as ``./dev`` does on a fresh machine)
the import system also sees it as the top-level ``operator``; a fresh CI run failed exactly there
(``cannot import name 'eq' from 'operator'``).

A fresh clone has no folder beside it: tests, scripts and docs that reached for a ``shared`` folder
next to the repository (or a fixed path on one machine) failed or skipped there.
"""

from __future__ import annotations

import re
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


PARTS = ("api", "kube", "runtime", "kernels", "autoscaler", "router")  # operator: the tests above


def python_at_root(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -c code` run in the checkout's root (which is then first on sys.path)."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.parametrize("part", PARTS)
def test_an_installed_module_named_like_a_part_wins_at_the_repo_root(part: str, tmp_path: Path) -> None:
    """A distribution that installs a top-level package named like a part (Hugging Face's `kernels`,
    which transformers >= 5.25 imports with every model) is what `import <part>` gives at the root."""
    (tmp_path / part).mkdir()
    (tmp_path / part / "__init__.py").write_text("INSTALLED = True\nfrom . import child\n")
    (tmp_path / part / "child.py").write_text("VALUE = 7\n")
    code = (
        f"import sys; sys.path.insert(1, {str(tmp_path)!r}); import {part}; from {part} import child; "
        f"assert {part}.INSTALLED and child.VALUE == 7, {part}.__file__; "
        f"assert sys.modules[{part!r}] is {part}"
    )
    proc = python_at_root(code)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("part", PARTS)
def test_a_bare_part_name_at_the_root_is_its_namesake_or_else_the_folder(part: str) -> None:
    """In this environment as it is: `import <part>` gives the installed namesake where there is one
    (`kernels` wherever transformers >= 5.25 is installed) and the folder where there is none."""
    code = (
        "import importlib.machinery, os, sys\n"
        "here = os.path.realpath(os.curdir)\n"
        "path = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]\n"
        f"other = importlib.machinery.PathFinder.find_spec({part!r}, path)\n"
        f"import {part}, kvpilot.{part}\n"
        f"want = other.origin if other else kvpilot.{part}.__file__\n"
        f"assert os.path.realpath({part}.__file__) == os.path.realpath(want), ({part}.__file__, want)\n"
    )
    proc = python_at_root(code)
    assert proc.returncode == 0, proc.stderr


def test_transformers_models_import_at_the_repo_root() -> None:
    """The CI failure this guards: `kernels/` shadowed Hugging Face's `kernels` (a transformers
    dependency since 5.25) and no transformers model class could be imported from the checkout."""
    proc = python_at_root("from transformers import LlamaForCausalLM; assert LlamaForCausalLM.__name__", 300)
    assert proc.returncode == 0, proc.stderr[-3000:]


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


# A folder beside the repository (spelled as a relative path or through pathlib), or a development
# machine's work tree. The patterns are written so that this file does not match them itself.
OUTSIDE = re.compile(
    r"\.\./shared\b"  # a relative path to the folder beside the repository
    r"|\.parent\s*/\s*[\"']shared[\"']"  # the same through pathlib (the root's parent)
    r"|(?<![\w.-])/wor[k]/"  # an absolute path under the machine's work folder
)
# Folders that .gitignore keeps out of the repository (used when the tree is not a git checkout).
UNTRACKED_DIRS = {
    ".git",
    ".venv",
    "__pycache__",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".hypothesis",
}


def repository_files() -> list[Path]:
    """The tracked files (git ls-files), or, in a tree without git metadata (an archive), every file
    outside the ignored folders."""
    proc = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, timeout=60, check=False
    )
    if proc.returncode == 0 and proc.stdout:
        return [ROOT / name for name in proc.stdout.decode().split("\0") if name]
    return [
        p for p in ROOT.rglob("*") if p.is_file() and not UNTRACKED_DIRS & set(p.relative_to(ROOT).parts[:-1])
    ]


def outside_references(text: str) -> list[str]:
    """Pure: the lines of `text` that name a path outside the repository."""
    return [line.strip() for line in text.splitlines() if OUTSIDE.search(line)]


def test_outside_references_are_recognised() -> None:
    found = outside_references(
        "a = ROOT.parent / 'sha" + "red' / 'x'\n"
        "see ../sha" + "red/traces/t.jsonl\n"
        'p = Path("' + "/".join(["", "work", "shared", "traces"]) + '")\n'  # built: no such line here
        "ok: tests/autoscaler/data, https://example.com/homework/, a shared prefix\n"
    )
    assert len(found) == 3, found


def test_no_file_in_the_repository_reads_outside_it() -> None:
    offenders = []
    for path in repository_files():
        if path.is_symlink() or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
        offenders += [f"{path.relative_to(ROOT)}: {line}" for line in outside_references(text)]
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)
