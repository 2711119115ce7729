"""Which instruction-set level the CPU kernels are built for, chosen at run time from the CPU's features.

Every C extension (kernels/csrc) is compiled for one explicit level, never `-march=native`, so a
fast path cannot exist for one ISA only and a test machine can build and run every level it can
execute:

  * ``avx512``: AVX-512 F/BW/DQ/VL/CD (x86-64-v4), plus AVX512-BF16 and AVX512-VNNI where the CPU
    has them (the flags are part of the build's cache key);
  * ``avx2``: AVX2 + FMA + F16C (x86-64-v3), the AMD EPYC / laptop class without AVX-512;
  * ``generic``: the portable C loops (x86-64 baseline SSE2, or the compiler's default elsewhere).

`selected()` picks the best level the CPU runs; the `cpu_isa` kernel switch (``--cpu-isa`` or
``KVPILOT_CPU_ISA=avx512|avx2|generic``, kernels/switches.py) forces one (tests and benchmarks force
the lower paths on an AVX-512 machine), and a level the CPU cannot run is refused with an error
naming the switch. The choice is logged once per level.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Iterable
from functools import cache
from pathlib import Path

from kvpilot.kernels import switches

log = logging.getLogger(__name__)

ENV = "KVPILOT_CPU_ISA"
LEVELS = switches.ISA_LEVELS  # best first
_NEEDS = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx2", "fma", "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "generic": frozenset(),
}


@cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read), less the
    ones KVPILOT_CPU_HIDE_FEATURES names (kernels/switches.py: the kernels then build and route as on a
    CPU without them)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    have = frozenset(line.partition(":")[2].split())
    hidden = switches.hidden_features(os.environ.get(switches.HIDE_FEATURES_ENV, ""))
    if hidden & have:
        log.info(
            "CPU features hidden by %s: %s", switches.HIDE_FEATURES_ENV, ", ".join(sorted(hidden & have))
        )
    return have - hidden


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def supported(features: Iterable[str], x86: bool = True) -> list[str]:
    """The levels a CPU with these features can run, best first (`generic` always)."""
    have = set(features)
    return [lvl for lvl in LEVELS if lvl == "generic" or (x86 and _NEEDS[lvl] <= have)]


def choose(features: Iterable[str], forced: str | None, x86: bool = True) -> str:
    """The level to use: `forced` (validated) or the best the CPU supports."""
    levels = supported(features, x86)
    if not forced:
        return levels[0]
    if forced not in LEVELS:
        raise ValueError(f"{ENV}={forced!r} is not one of {', '.join(LEVELS)}")
    if forced not in levels:
        raise ValueError(f"{ENV}={forced} needs CPU features this CPU lacks (it runs {', '.join(levels)})")
    return forced


def compile_flags(level: str, features: Iterable[str], x86: bool = True) -> list[str]:
    """The compiler's target flags for `level` (for avx512, BF16/VNNI only where the CPU has them)."""
    have = set(features)
    if not x86:
        return []  # only the generic level exists off x86; the compiler's default target
    if level == "avx512":
        extra = [
            flag
            for feat, flag in (("avx512_bf16", "-mavx512bf16"), ("avx512_vnni", "-mavx512vnni"))
            if feat in have
        ]
        return ["-march=x86-64-v4", "-mtune=generic", *extra]
    if level == "avx2":
        return ["-march=x86-64-v3", "-mtune=generic"]
    if level == "generic":
        return ["-march=x86-64", "-mtune=generic"]
    raise ValueError(f"unknown ISA level {level!r}")


def selected() -> str:
    """The level the kernels use in this process: the `cpu_isa` switch (kernels/switches.py) or the
    CPU's best."""
    return _selected(switches.current().cpu_isa)


@cache
def _selected(forced: str | None) -> str:
    level = choose(cpu_features(), forced, is_x86())
    how = "forced by --cpu-isa / KVPILOT_CPU_ISA" if forced else "the best this CPU runs"
    log.info("CPU kernels: ISA %s (%s; this CPU runs %s)", level, how, ", ".join(runnable()))
    return level


def runnable() -> list[str]:
    """The levels this CPU can run, best first: what the kernel tests cover."""
    return supported(cpu_features(), is_x86())


def flags_for(level: str) -> list[str]:
    return compile_flags(level, cpu_features(), is_x86())


def native_bf16(level: str | None = None) -> bool:
    """Whether the CPU has native bf16 arithmetic at `level` (AVX512-BF16 or AMX-BF16 need AVX-512)."""
    level = level or selected()
    return level == "avx512" and bool({"avx512_bf16", "amx_bf16"} & cpu_features())


def bf16_dot(level: str | None = None) -> bool:
    """Whether the C kernels at `level` have `vdpbf16ps` (AVX512-BF16: compile_flags adds it at avx512
    where the CPU has it): the bf16 tiled kernel's int4 path (kernels/csrc/qmatmul_cpu.c)."""
    return (level or selected()) == "avx512" and "avx512_bf16" in cpu_features()
