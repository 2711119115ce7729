"""Skip locally, fail under CI: tests/needs.py, and that every missing-tool path goes through it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import needs

ROOT = Path(__file__).resolve().parents[1]
ABSENT = "kvpilot-no-such-tool-xyz"


@pytest.mark.parametrize("value", ["true", "1", "TRUE", "yes"])
def test_under_ci_the_missing_thing_fails_the_test_naming_it(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("CI", value)
    with pytest.raises(
        pytest.fail.Exception, match=f"CI=true and {ABSENT} \\(not found on PATH\\) is missing: get it"
    ):
        needs.require_tool(ABSENT, "get it")
    with pytest.raises(pytest.fail.Exception, match="Python module kvpilot_no_such_module"):
        needs.require_module("kvpilot_no_such_module")


@pytest.mark.parametrize("value", [None, "", "false", "0"])
def test_locally_the_missing_thing_skips_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.skip.Exception, match=f"{ABSENT} \\(not found on PATH\\) is missing: get it"):
        needs.require_tool(ABSENT, "get it")


def test_present_things_are_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert needs.require_tool("sh").endswith("/sh")
    assert needs.require_module("json").dumps([]) == "[]"


def test_no_test_skips_for_a_missing_tool_on_its_own() -> None:
    """pytest.skip / skipif / importorskip only for hardware (GPU, AVX-512) or through tests/needs.py."""
    allowed = re.compile(r"cuda|gpu|avx|flash_attn", re.IGNORECASE)
    offenders = []
    for path in [*ROOT.joinpath("tests").rglob("*.py"), *ROOT.joinpath("e2e").rglob("*.py")]:
        if path.name in ("needs.py", "test_needs.py"):
            continue
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.search(r"pytest\.(skip\(|importorskip|mark\.skip)", line):
                context = "\n".join(lines[max(0, i - 3) : i + 3])
                if not allowed.search(context):
                    offenders.append(f"{path.relative_to(ROOT)}:{i + 1}: {line.strip()}")
    assert offenders == []


def test_a_module_level_miss_fails_collection_under_ci(tmp_path: Path) -> None:
    """The module-level use (tests/api/celcheck.py) errors the run under CI, never passes it."""
    test = tmp_path / "test_mod.py"
    test.write_text(
        "from tests.needs import require_module\n"
        "require_module('kvpilot_no_such_module', 'pip install it')\n"
        "def test_x():\n    pass\n"
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    run = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(test),
        "--rootdir",
        str(tmp_path),
    ]
    ci = subprocess.run(run, capture_output=True, text=True, env={**env, "CI": "true"}, cwd=tmp_path)
    assert ci.returncode != 0 and "CI=true and Python module kvpilot_no_such_module" in ci.stdout, ci.stdout
    local = subprocess.run(run, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert local.returncode in (0, 5) and "1 skipped" in local.stdout, local.stdout  # 5: nothing ran
