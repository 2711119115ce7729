"""Build the C extensions in kernels/csrc on first use, with the system C compiler, and cache them.

A library is compiled once per source, flags, compiler and CPU into ~/.cache/kvpilot/kernels (or
the `kernel_cache` switch: --kernel-cache-dir, $KVPILOT_KERNEL_CACHE; kernels/switches.py) and loaded with ctypes by its module (cpu_attention.py, cpu_ops.py); without a
C compiler those modules report themselves unavailable and the runtime uses its torch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from kvpilot.kernels import isa, switches

log = logging.getLogger(__name__)
_lock = threading.Lock()


# -ffast-math's optimizations, flag by flag, without -ffast-math (or -funsafe-math-optimizations)
# itself: given either at link time, GCC links crtfastmath.o into the shared library, and its
# constructor turns on flush-to-zero and denormals-are-zero for the whole process (torch and every
# other library in it) the moment the library is loaded (tests/kernels/test_cbuild.py).
FAST_MATH = [
    "-fno-math-errno",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-fassociative-math",
    "-freciprocal-math",
    "-ffinite-math-only",
    "-fcx-limited-range",
]


class KernelBuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(switches.current().kernel_cache or Path.home() / ".cache" / "kvpilot" / "kernels")


def _cpu_signature() -> str:
    try:
        return next(
            (ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), ""
        )
    except OSError:
        return ""


def build(source: Path, flags: Sequence[str], compiler: str | None = None) -> Path:
    """The shared library of `source` built with `flags`: from the cache, or compiled now."""
    cc = compiler or switches.current().compiler or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise KernelBuildError("no C compiler (gcc/cc) on PATH")
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what it may include
    key = hashlib.sha256(
        source.read_bytes() + headers + " ".join([cc, *flags]).encode() + _cpu_signature().encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    with _lock:
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            tmp_out = Path(tmp) / target.name
            proc = subprocess.run(
                [cc, *flags, str(source), "-o", str(tmp_out), "-lm"], capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise KernelBuildError(f"{cc} failed to build {source.name}:\n{proc.stderr[-2000:]}")
            os.replace(tmp_out, target)  # atomic: concurrent builders never see a half-written file
    log.info("built %s: %s", source.name, target)
    return target


class Extension:
    """One C extension: built per ISA level (kernels/isa.py) on first use, loaded with ctypes, its
    functions declared by `declare`. `available()` is False, with one warning saying what runs
    instead (`fallback`), when it cannot be built or the `cpu_kernels` switch is off
    (--no-cpu-kernels, KVPILOT_DISABLE_CPU_KERNEL=1; kernels/switches.py)."""

    def __init__(
        self, source: Path, cflags: Sequence[str], declare: Callable[[ctypes.CDLL], None], fallback: str
    ) -> None:
        self.source, self.cflags, self.declare, self.fallback = source, list(cflags), declare, fallback
        self._libraries: dict[str, ctypes.CDLL] = {}
        # level -> the ISA the C code says it was built for, asked once as the library is loaded:
        # built_isa() is on the per-matmul path (kernels/qlinear.max_kernel_rows), a ctypes call is not
        self._built_isa: dict[str, str] = {}
        self.isa_queries = 0  # how many times the C code was asked its ISA: once per level loaded
        self._failed: dict[str, str] = {}  # level -> why it cannot be built (tried once)
        self._lock = threading.Lock()

    def build(self, level: str | None = None, compiler: str | None = None) -> Path:
        return build(self.source, [*self.cflags, *isa.flags_for(level or isa.selected())], compiler)

    def library(self, level: str | None = None) -> ctypes.CDLL:
        level = level or isa.selected()
        loaded = self._libraries.get(level)  # the per-call path: no lock once loaded
        if loaded is not None:
            return loaded
        with self._lock:
            if level not in self._libraries:
                lib = ctypes.CDLL(str(self.build(level)))
                lib.kvpilot_isa.argtypes = []
                lib.kvpilot_isa.restype = ctypes.c_char_p
                self.declare(lib)
                self._built_isa[level] = self._ask_isa(lib)
                self._libraries[level] = lib
            return self._libraries[level]

    def _ask_isa(self, lib: ctypes.CDLL) -> str:
        """The C code's own answer (a ctypes call, counted in isa_queries)."""
        self.isa_queries += 1
        return str(lib.kvpilot_isa().decode())

    def built_isa(self, level: str | None = None) -> str:
        """The ISA level the library was compiled for, as the C code sees it (tests check the flags);
        read from the library once, when it is loaded for `level`."""
        level = level or isa.selected()
        built = self._built_isa.get(level)
        if built is None:
            self.library(level)
            built = self._built_isa[level]
        return built

    def available(self, level: str | None = None) -> bool:
        if not switches.current().cpu_kernels:
            return False
        level = level or isa.selected()
        if level in self._libraries:
            return True
        if level in self._failed:
            return False
        try:
            self.library(level)
        except (KernelBuildError, OSError) as exc:
            self._failed[level] = str(exc)
            log.warning("%s unavailable, %s: %s", self.source.name, self.fallback, exc)
            return False
        return True
