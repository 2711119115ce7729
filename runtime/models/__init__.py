"""Model registry: architecture names (HF `architectures[0]`, GGUF `general.architecture`) -> classes."""

from __future__ import annotations

from kvpilot.runtime.models.arch_config import ModelArchConfig
from kvpilot.runtime.models.base import CausalLM
from kvpilot.runtime.models.llama import LlamaForCausalLM
from kvpilot.runtime.models.moe_llm import MoEForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MoEForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "OlmoeForCausalLM": MoEForCausalLM,
    "llama": LlamaForCausalLM,  # GGUF general.architecture (Llama, Mistral, SmolLM GGUFs)
    "llama-moe": MoEForCausalLM,  # GGUF `llama` with llama.expert_count > 0 (Mixtral GGUFs)
    "qwen2moe": MoEForCausalLM,
    "qwen3moe": MoEForCausalLM,
    "olmoe": MoEForCausalLM,
}


def get_model_class(architecture: str) -> type[CausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {sorted(MODEL_REGISTRY)}"
        ) from None


__all__ = [
    "MODEL_REGISTRY",
    "CausalLM",
    "LlamaForCausalLM",
    "MoEForCausalLM",
    "ModelArchConfig",
    "get_model_class",
]
