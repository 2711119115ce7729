"""What every benchmark shares: the machine it ran on, JSON output, one table printer, the common
flags and the subcommand dispatch of the entry points. Torch-free, so `--help` stays fast.

An entry point (benchmarks/<question>.py) either measures itself or dispatches subcommands to the
modules in benchmarks/<folder>/ (`dispatch`); every benchmark prints one JSON document that names the
machine (`machine()`: the CPU as lscpu names it, its ISA flags, cores, load, git commit, date).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# The ISA flags a figure depends on (as /proc/cpuinfo spells them).
ISA_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


# ---------------------------------------------------------------------------------------------
# The machine


def _cpuinfo() -> tuple[str | None, set[str], int | None]:
    """(model name, flags, physical cores) from /proc/cpuinfo (None / empty where it is absent)."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return None, set(), None
    model: str | None = None
    flags: set[str] = set()
    cores: set[tuple[str, str]] = set()
    phys = ""
    for line in path.read_text().splitlines():
        key, _, val = line.partition(":")
        key, val = key.strip(), val.strip()
        if key == "model name" and model is None:
            model = val
        elif key == "flags" and not flags:
            flags = set(val.split())
        elif key == "physical id":
            phys = val
        elif key == "core id":
            cores.add((phys, val))
    return model, flags, len(cores) or None


def cpu_model() -> str:
    """The CPU as lscpu names it ("Model name"), else /proc/cpuinfo's, else platform's, else "unknown"."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return _cpuinfo()[0] or platform.processor() or "unknown"


def cpu_flags() -> dict[str, bool]:
    """Which of ISA_FLAGS this CPU has."""
    flags = _cpuinfo()[1]
    return {f: f in flags for f in ISA_FLAGS}


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine() -> dict[str, Any]:
    """The machine a figure was measured on: CPU (lscpu), AVX-512 yes/no, ISA flags, cores, memory,
    load average, Python, platform, git commit and the UTC time."""
    _, _, physical = _cpuinfo()
    flags = cpu_flags()
    mem_gib = None
    if Path("/proc/meminfo").exists():
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    return {
        "cpu_model": cpu_model(),
        "avx512": flags["avx512f"],
        "flags": flags,
        "logical_cpus": os.cpu_count(),
        "physical_cores": physical,
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_gib": mem_gib,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


# ---------------------------------------------------------------------------------------------
# Output


def write_json(doc: Any, path: str | Path | None) -> None:
    """Write `doc` as indented JSON to `path` (its folder made), if a path is given."""
    if path is None:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(doc, indent=2) + "\n")


def emit(doc: Any, path: str | Path | None = None) -> None:
    """Print `doc` as indented JSON on stdout, and write it to `path` too when one is given."""
    print(json.dumps(doc, indent=2), flush=True)
    write_json(doc, path)


def table_header(headers: Sequence[str]) -> str:
    """The first two lines of a markdown table."""
    return "| " + " | ".join(headers) + " |\n|" + "---|" * len(headers)


def table_row(cells: Iterable[Any]) -> str:
    """One markdown table row; None prints as an empty cell."""
    return "| " + " | ".join("" if c is None else str(c) for c in cells) + " |"


def markdown_table(headers: Sequence[str], rows: Iterable[Iterable[Any]]) -> str:
    """The one table printer: a markdown table of `rows` (already formatted cells) under `headers`."""
    return "\n".join([table_header(headers), *(table_row(r) for r in rows)])


def print_table(headers: Sequence[str], rows: Iterable[Iterable[Any]]) -> None:
    print(markdown_table(headers, rows), flush=True)


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The value at rank round(q% x (n - 1)) of the sorted values (q in 0..100)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


# ---------------------------------------------------------------------------------------------
# Flags


def add_output_arg(ap: argparse.ArgumentParser, flag: str = "--output") -> None:
    """`--output FILE` (or `--out`): write the JSON document there too."""
    ap.add_argument(flag, type=Path, default=None, help="write the JSON document here too")


def add_markdown_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--markdown", action="store_true", help="also print the markdown table")


def add_jobs_arg(ap: argparse.ArgumentParser, default: int = 2) -> None:
    ap.add_argument("--jobs", type=int, default=default, help="simulations run in parallel processes")


# ---------------------------------------------------------------------------------------------
# Entry points with subcommands


def dispatch(
    doc: str, commands: dict[str, str], argv: Sequence[str] | None = None, own_name: Iterable[str] = ()
) -> None:
    """Run the subcommand named by argv[0]: `commands` maps each name to a module (a path under
    benchmarks/, e.g. "quality.dtype") whose main() parses the rest of argv with its own flags (for
    the names in `own_name`, argv with the name: that module's parser has the subcommands itself).
    The module is imported only when chosen, so `--help` of the entry point imports nothing heavy."""
    args = list(sys.argv[1:] if argv is None else argv)
    prog = Path(sys.argv[0]).name
    if not args or args[0] in ("-h", "--help") or args[0] not in commands:
        lines = [doc.strip(), "", f"usage: {prog} {{{','.join(commands)}}} [flags]", "", "subcommands:"]
        for name, module in commands.items():
            lines.append(f"  {name:<18} benchmarks/{module.replace('.', '/')}.py ({prog} {name} --help)")
        print("\n".join(lines))
        if args and args[0] not in ("-h", "--help"):
            raise SystemExit(f"{prog}: unknown subcommand {args[0]!r} (choose from {', '.join(commands)})")
        raise SystemExit(0 if args else 2)
    name, rest = args[0], args[1:]
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    module = importlib.import_module(commands[name])
    sys.argv = [prog, name, *rest] if name in set(own_name) else [f"{prog} {name}", *rest]
    raise SystemExit(module.main())
