"""The kernel switches: which CPU kernels run and how, one typed value per process.

Each switch is an EngineConfig field and a `kvpilot serve` flag (runtime/config.py, docs/runtime.md,
"Kernel switches"); an environment variable of the same meaning overrides it. `from_environ` is the
one place that reads those variables, `resolve` the one that applies them, and the engine build hands
the result to `use` before it loads the model (the kernels' libraries are process-wide, so is the
choice). Nothing is read at import: until an engine is built, `current()` is the defaults with the
environment's overrides, resolved on first use.

| switch | flag | environment override |
|---|---|---|
| cpu_isa: the ISA level the C kernels are built for (kernels/isa.py) | --cpu-isa | KVPILOT_CPU_ISA |
| cpu_kernels: False runs the torch paths instead of the C kernels | --no-cpu-kernels | KVPILOT_DISABLE_CPU_KERNEL=1 |
| qmatmul_activations: int8 or int16 (rounded per block of 32), bf16 (each rounded to bfloat16) or float (exact) | --qmatmul-activations | KVPILOT_QMATMUL_ACTIVATIONS |
| cpu_decoder_stack: the runner may run a step's decoder layers in one C call | --no-cpu-decoder-stack | KVPILOT_CPU_DECODER_STACK=0 |
| kernel_cache: where built libraries are kept | --kernel-cache-dir | KVPILOT_KERNEL_CACHE |
| compiler: the C compiler (default gcc, then cc) | | CC |
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

ISA_LEVELS = ("avx512", "avx2", "generic")
Activations = Literal["int8", "int16", "bf16", "float"]
ACTIVATIONS: tuple[Activations, ...] = ("int8", "int16", "bf16", "float")


@dataclass(frozen=True)
class KernelSwitches:
    cpu_isa: str | None = None  # one of ISA_LEVELS; None: the best level the CPU runs
    cpu_kernels: bool = True
    qmatmul_activations: Activations = "int8"
    cpu_decoder_stack: bool = True
    kernel_cache: str | None = None  # None: ~/.cache/kvpilot/kernels
    compiler: str | None = None  # None: gcc, else cc, from PATH

    def __post_init__(self) -> None:
        if self.cpu_isa is not None and self.cpu_isa not in ISA_LEVELS:
            raise ValueError(f"cpu_isa={self.cpu_isa!r} is not one of {', '.join(ISA_LEVELS)}")
        if self.qmatmul_activations not in ACTIVATIONS:
            raise ValueError(
                f"qmatmul_activations={self.qmatmul_activations!r}: expected {', '.join(ACTIVATIONS)}"
            )

    @property
    def int8_activations(self) -> bool:
        return self.qmatmul_activations == "int8"


def _choice(name: str, value: str, choices: Mapping[str, Any]) -> Any:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected {' or '.join(choices)}")
    return choices[value]


# variable -> (field, its value for the variable's text); an unset or empty variable overrides nothing
ENVIRONMENT: dict[str, tuple[str, Any]] = {
    "KVPILOT_CPU_ISA": ("cpu_isa", lambda v: _choice("KVPILOT_CPU_ISA", v, {x: x for x in ISA_LEVELS})),
    "KVPILOT_DISABLE_CPU_KERNEL": (
        "cpu_kernels",
        lambda v: _choice("KVPILOT_DISABLE_CPU_KERNEL", v, {"1": False, "0": True}),
    ),
    "KVPILOT_QMATMUL_ACTIVATIONS": (
        "qmatmul_activations",
        lambda v: _choice("KVPILOT_QMATMUL_ACTIVATIONS", v, {a: a for a in ACTIVATIONS}),
    ),
    "KVPILOT_CPU_DECODER_STACK": (
        "cpu_decoder_stack",
        lambda v: _choice("KVPILOT_CPU_DECODER_STACK", v, {"0": False, "1": True}),
    ),
    "KVPILOT_KERNEL_CACHE": ("kernel_cache", str),
    "CC": ("compiler", str),
}
assert {f for f, _ in ENVIRONMENT.values()} == {f.name for f in fields(KernelSwitches)}


# CPU feature flags to treat as absent (comma-separated /proc/cpuinfo names), read by kernels/isa.py's
# cpu_features for the whole process: the kernels' builds and every routing decision then follow a CPU
# without them, as KVPILOT_CPU_ISA takes a lower level (scripts/test.sh runs the kernel-sensitive tests
# as an AVX-512 CPU without BF16 and VNNI this way). Validated with the switches (resolve).
HIDE_FEATURES_ENV = "KVPILOT_CPU_HIDE_FEATURES"


def hidden_features(value: str) -> frozenset[str]:
    """Pure: the feature names of a KVPILOT_CPU_HIDE_FEATURES value; a name that is not a /proc/cpuinfo
    flag's form (lowercase letters, digits, underscores) raises ValueError naming the variable."""
    names = frozenset(v.strip() for v in value.split(",") if v.strip())
    bad = sorted(n for n in names if not all(c.islower() or c.isdigit() or c == "_" for c in n))
    if bad:
        raise ValueError(
            f"{HIDE_FEATURES_ENV}={value!r}: {', '.join(bad)} is not a CPU feature name as /proc/cpuinfo writes it"
        )
    return names


def from_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    """Pure: the overrides `environ` sets, by field. A value a variable does not take raises
    ValueError naming the variable and the values it takes."""
    return {field: parse(environ[var]) for var, (field, parse) in ENVIRONMENT.items() if environ.get(var)}


def resolve(configured: KernelSwitches | None = None) -> KernelSwitches:
    """`configured` (from EngineConfig; default: the defaults) with the process environment's
    overrides: the one place that reads the environment for the kernels (KVPILOT_CPU_HIDE_FEATURES
    validated here too)."""
    hidden_features(os.environ.get(HIDE_FEATURES_ENV, ""))
    return replace(configured or KernelSwitches(), **from_environ(os.environ))


_current: KernelSwitches | None = None


def current() -> KernelSwitches:
    """The switches in force in this process (resolved from the environment on first use when no
    engine has set them)."""
    global _current
    if _current is None:
        _current = resolve()
    return _current


def use(switches: KernelSwitches) -> KernelSwitches:
    """Put `switches` in force (the engine build, before it loads the model); returns the previous."""
    global _current
    previous = current()
    _current = switches
    return previous


def changed(**changes: Any) -> KernelSwitches:
    """The current switches with `changes` (to `use`)."""
    return replace(current(), **changes)


@contextlib.contextmanager
def using(**changes: Any) -> Iterator[KernelSwitches]:
    """The current switches with `changes` in force for the block (tests, benchmarks)."""
    switches = changed(**changes)
    previous = use(switches)
    try:
        yield switches
    finally:
        use(previous)
