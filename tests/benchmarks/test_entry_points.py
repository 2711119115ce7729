"""Every benchmark entry point answers --help, and so does every subcommand (benchmarks/harness.py's
dispatch): a renamed module, a broken import or a parser error shows here, not in the middle of a
long run. The entry points run as a user runs them (a subprocess each); the subcommands' --help run
in one subprocess so torch is imported once."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402

# The files in benchmarks/ that are not entry points.
NOT_ENTRY_POINTS = {"harness.py", "workload.py"}
ENTRY_POINTS = sorted(p.name for p in BENCH.glob("*.py") if p.name not in NOT_ENTRY_POINTS)
# entry point -> its subcommands (read from the file's COMMANDS / SUBCOMMANDS dict, so a new one is
# checked without editing this test)


def subcommands(path: Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        named = isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in ("COMMANDS", "SUBCOMMANDS") for t in node.targets
        )
        if named and isinstance(node.value, ast.Dict):
            return [ast.literal_eval(k) for k in node.value.keys if k is not None]
    return []


DISPATCHERS = {name: subcommands(BENCH / name) for name in ENTRY_POINTS if subcommands(BENCH / name)}


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_every_script_in_benchmarks_is_an_entry_point_or_the_harness() -> None:
    assert "runtime_vs_peers.py" in ENTRY_POINTS
    assert {"runtime_quality.py", "kernels_bench.py", "router_bench.py"} <= set(DISPATCHERS)
    # the modules behind the subcommands live in folders, never next to the entry points
    for folder in ("peers", "features", "quality", "micro", "fleet"):
        assert (BENCH / folder / "__init__.py").exists()


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_entry_point_help(script: str) -> None:
    res = run(str(BENCH / script), "--help")
    assert res.returncode == 0, res.stderr
    assert "usage:" in res.stdout


def test_every_subcommand_help_in_one_process() -> None:
    cases = [(entry, sub) for entry, subs in DISPATCHERS.items() for sub in subs]
    assert ("runtime_vs_peers.py", "suite") in cases and ("kernels_bench.py", "qmoe") in cases
    code = f"""
import json, runpy, sys, io, contextlib
sys.path.insert(0, {str(BENCH)!r})
failed = {{}}
for entry, sub in {cases!r}:
    sys.argv = [{str(BENCH)!r} + "/" + entry, sub, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(sys.argv[0], run_name="__main__")
        failed[entry + " " + sub] = "returned without exiting"
    except SystemExit as e:
        if e.code not in (0, None) or "usage:" not in out.getvalue():
            failed[entry + " " + sub] = f"exit {{e.code}}: {{out.getvalue()[-300:]}}"
    except Exception as e:
        failed[entry + " " + sub] = repr(e)
print(json.dumps(failed))
"""
    res = run("-c", code, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {}


def test_dispatch_refuses_an_unknown_subcommand_naming_it() -> None:
    res = run(str(BENCH / "kernels_bench.py"), "nope")
    assert res.returncode != 0
    assert "unknown subcommand 'nope'" in res.stderr


def test_machine_names_the_cpu_and_avx512() -> None:
    m = harness.machine()
    assert m["cpu_model"] and m["cpu_model"] == harness.cpu_model()
    assert m["avx512"] == m["flags"]["avx512f"]
    assert set(m["flags"]) == set(harness.ISA_FLAGS)
    assert m["date_utc"].endswith("Z")


def test_one_table_printer() -> None:
    table = harness.markdown_table(["a", "b"], [[1, None], ["x", 2.5]])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1 |  |", "| x | 2.5 |"]
