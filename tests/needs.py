"""Skip locally, fail under CI: the one way tests say that something they need is missing.

A developer without helm, promtool, lupa or the e2e control plane still gets a green run of what their
machine can do, with the reason for each skip. Under CI (`CI=true`, as GitHub Actions, GitLab and
most CI systems set it) the same test fails instead, naming what is missing, so a suite cannot pass by
skipping. Hardware a machine may simply not have (a CUDA GPU, AVX-512) is not "missing": those tests
keep skipping everywhere, CI included (use `pytest.skip` for them).
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest

TRUE = {"1", "true", "yes", "on"}


def under_ci() -> bool:
    """Whether the CI environment variable says this run is CI."""
    return os.environ.get("CI", "").strip().lower() in TRUE


def missing(what: str, hint: str = "") -> NoReturn:
    """Skip (locally) or fail (under CI) because `what` is not available; `hint`: how to get it."""
    reason = f"{what} is missing" + (f": {hint}" if hint else "")
    if under_ci():
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_tool(name: str, hint: str = "", path: str | None = None) -> str:
    """The path of executable `name` (given `path`, else found on PATH), or `missing()`."""
    found = path if path is not None else shutil.which(name)
    if not found:
        missing(f"{name} (not found on PATH)" if path is None else name, hint)
    return found


def require_module(name: str, hint: str = "") -> ModuleType:
    """Import module `name`, or `missing()` (pytest.importorskip that fails under CI)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(f"Python module {name} ({exc})", hint)
