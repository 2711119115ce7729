"""Kernel tests run at every ISA level this CPU can execute (kernels/isa.py): avx512, avx2, generic."""

from __future__ import annotations

import pytest

from kvpilot.kernels import isa


@pytest.fixture(params=isa.runnable())
def cpu_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The ISA level the CPU kernels are built for and used at during this test."""
    level = str(request.param)
    monkeypatch.setattr(isa, "selected", lambda: level)
    return level
