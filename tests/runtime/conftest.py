"""Runtime fixtures: the Hugging Face reference model and engines around the shared SmolLM2 weights."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvpilot.runtime.engine.build import engine_from_loaded
from tests.needs import require_module

if TYPE_CHECKING:
    from kvpilot.runtime.engine.core import LLMEngine
    from kvpilot.runtime.load.loader import LoadedModel


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
    """Build an engine with its own KV pool and scheduler around the session's fp32 model, its KV cache
    in float32 too (the model's exact arithmetic, as the parity tests compare; the default is a bfloat16
    cache under float32 activations: test_default_quality.py holds it to the quality bar)."""
    from kvpilot.runtime.config import EngineConfig

    def make(**overrides: Any) -> LLMEngine:
        settings: dict[str, Any] = {
            "dtype": "float32",
            "kv_cache_memory": 256 * 2**20,
            "kv_cache_dtype": "float32",
            **overrides,
        }
        cfg = EngineConfig(**settings)
        return engine_from_loaded(smollm2_fp32, cfg)

    return make


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch, and the C kernels (they take torch.get_num_threads()), on one thread for a test module:
    results then do not depend on how a parallel sum was split, and modules do not compete for the
    cores (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def no_tp_leftovers(one_torch_thread: None) -> Iterator[None]:
    """one_torch_thread, and after the module no tensor-parallel worker process still running."""
    yield
    leftovers = [p for p in multiprocessing.active_children() if p.name.startswith("kvpilot-tp")]
    assert not leftovers, f"tensor-parallel workers still running: {leftovers}"
