"""The layout holds: each part imports only what docs/architecture.md's import table allows, the
HTTP front end knows the engine only through its contract, and the control plane never loads torch."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("api", "kube", "operator", "router", "autoscaler", "runtime", "kernels")
SHARED = ("request_body", "net")  # kvpilot/<module>.py helpers any part may use
CONTROL_PLANE = ("api", "kube", "operator", "router", "autoscaler")


def allowed_imports() -> dict[str, set[str]]:
    """docs/architecture.md's "Import rules" table: part -> the parts (or part.modules) it may import."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Import rules", 1)[1].split("\n## ", 1)[0]
    table: dict[str, set[str]] = {}
    for row in re.findall(r"^\| `(\w+)` \| (.+?) \|$", section, flags=re.M):
        table[row[0]] = set(re.findall(r"`([\w.]+)`", row[1]))
    return table


def kvpilot_imports(path: Path) -> set[str]:
    """The kvpilot modules a file imports (module-level or not), without the `kvpilot.` prefix."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvpilot."):
            found.add(node.module.removeprefix("kvpilot."))
            for alias in node.names:  # `from kvpilot.runtime.engine import sampler`
                found.add(f"{node.module.removeprefix('kvpilot.')}.{alias.name}")
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("kvpilot.") for a in node.names if a.name.startswith("kvpilot."))
    return found


def part_files(part: str) -> list[Path]:
    return sorted(p for p in (ROOT / part).rglob("*.py") if "__pycache__" not in p.parts)


def test_the_table_names_every_part() -> None:
    assert set(allowed_imports()) == set(PARTS)


@pytest.mark.parametrize("part", PARTS)
def test_a_part_imports_only_what_the_table_allows(part: str) -> None:
    allowed = allowed_imports()[part]
    bad = []
    for path in part_files(part):
        for mod in kvpilot_imports(path):
            target = mod.split(".")[0]
            if target in (part, *SHARED) or target not in PARTS:
                continue
            if not any(mod == a or mod.startswith(a + ".") for a in allowed):
                bad.append(f"{path.relative_to(ROOT)} imports kvpilot.{mod}")
    assert not bad, "edges docs/architecture.md does not draw:\n" + "\n".join(bad)


def test_serving_knows_the_engine_only_through_its_contract() -> None:
    allowed = (
        "runtime.engine.protocol",
        "runtime.engine.sampling_params",
        # the KV transfer's torch-free parts: the wire format, the request field, the pull
        "runtime.engine.kv_transfer.wire",
        "runtime.engine.kv_transfer.params",
        "runtime.engine.kv_transfer.client",
    )
    bad = []
    for path in part_files("runtime/serving"):
        for mod in kvpilot_imports(path):
            if mod.startswith(("runtime.engine", "runtime.load", "runtime.models", "kernels")) and not (
                mod.startswith(allowed)
            ):
                bad.append(f"{path.relative_to(ROOT)} imports kvpilot.{mod}")
    assert not bad, "\n".join(bad)


def _loads_torch(modules: list[str]) -> list[str]:
    """Imports `modules` in order in one fresh interpreter; the first whose import loaded torch."""
    code = "\n".join(
        [
            "import importlib, sys",
            "for m in sys.argv[1:]:",
            "    importlib.import_module(m)",
            "    if 'torch' in sys.modules:",
            "        print(m)",
            "        break",
        ]
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *modules], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def _module_names(folder: str) -> list[str]:
    names = []
    for path in part_files(folder):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        names.append("kvpilot." + ".".join(parts))
    return names


def test_the_front_end_and_the_engine_contract_do_not_load_torch() -> None:
    modules = [
        *_module_names("runtime/serving"),
        "kvpilot.runtime.engine.protocol",
        "kvpilot.runtime.grammar.service",
        "kvpilot.runtime.engine.kv_transfer.pins",
    ]
    assert _loads_torch(modules) == []


@pytest.mark.parametrize("part", CONTROL_PLANE)
def test_the_control_plane_never_loads_torch(part: str) -> None:
    assert _loads_torch(_module_names(part)) == []
