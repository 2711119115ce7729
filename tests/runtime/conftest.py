"""Runtime fixtures: the Hugging Face reference model and engines around the shared SmolLM2 weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from tests.needs import require_module

if TYPE_CHECKING:
    from kvpilot.runtime.engine import LLMEngine
    from kvpilot.runtime.loader import LoadedModel


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path: Path) -> Any:
    """transformers' own model from the same GGUF file, float32, eval mode."""
    transformers = require_module("transformers", "pip install -e .[test]")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def make_engine(smollm2_fp32: LoadedModel) -> Callable[..., LLMEngine]:
    """Build an engine with its own KV pool and scheduler around the session's fp32 model."""
    from kvpilot.runtime.config import EngineConfig
    from kvpilot.runtime.engine import LLMEngine

    def make(**overrides: Any) -> LLMEngine:
        settings: dict[str, Any] = {"dtype": "float32", "kv_cache_memory": 256 * 2**20, **overrides}
        cfg = EngineConfig(**settings)
        return LLMEngine.from_loaded(smollm2_fp32, cfg)

    return make
