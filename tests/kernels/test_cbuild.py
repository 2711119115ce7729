"""Loading a C extension must not change the process's floating-point environment."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpilot.kernels import isa

PROBE = """
import sys
import torch
from kvpilot.kernels import {module} as m
tiny = torch.tensor([1e-40], dtype=torch.float32)  # a float32 subnormal
assert (tiny * 1.0).item() != 0.0, "subnormals flushed before loading"
m._library({level!r})
print((tiny * 1.0).item())
"""


@pytest.mark.parametrize("module", ["cpu_attention", "cpu_ops", "qlinear"])
@pytest.mark.parametrize("level", isa.runnable())
def test_loading_a_kernel_keeps_subnormals(module: str, level: str) -> None:
    """-ffast-math at link time puts crtfastmath.o into a shared library, whose constructor sets
    flush-to-zero / denormals-are-zero for every thread of the process (torch's ops included)."""
    probe = PROBE.format(module=module, level=level)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.strip()) != 0.0, f"{module} at {level} flushed subnormals to zero"
