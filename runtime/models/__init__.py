"""Model registry: architecture names (HF `architectures[0]`, GGUF `general.architecture`) -> classes."""

from __future__ import annotations

from kvpilot.runtime.models.arch_config import ModelArchConfig
from kvpilot.runtime.models.base import CausalLM
from kvpilot.runtime.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "llama": LlamaForCausalLM,  # GGUF general.architecture (Llama, Mistral, SmolLM GGUFs)
}


def get_model_class(architecture: str) -> type[CausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {sorted(MODEL_REGISTRY)}"
        ) from None


__all__ = ["MODEL_REGISTRY", "CausalLM", "LlamaForCausalLM", "ModelArchConfig", "get_model_class"]
