"""The supported architectures (HF `architectures[0]`, GGUF `general.architecture`), their classes and
formats: the one table the loader and the registry read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvpilot.runtime.models.arch_config import ModelArchConfig
from kvpilot.runtime.models.base import CausalLM
from kvpilot.runtime.models.llama import LlamaForCausalLM
from kvpilot.runtime.models.moe_llm import MoEForCausalLM


@dataclass(frozen=True)
class Architecture:
    """One architecture name kvpilot loads: the class that runs it, the checkpoint format that names
    it that way, and whether it is a mixture of experts."""

    model: type[CausalLM]
    source: Literal["hf", "gguf", "derived"]  # `derived`: never in a file; the loader names it
    moe: bool


# The one table of supported architectures: HF `architectures[0]` and GGUF `general.architecture`.
ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM, "hf", moe=False),
    "MistralForCausalLM": Architecture(LlamaForCausalLM, "hf", moe=False),
    "Qwen2ForCausalLM": Architecture(LlamaForCausalLM, "hf", moe=False),
    "Qwen3ForCausalLM": Architecture(LlamaForCausalLM, "hf", moe=False),  # q/k RMSNorm per head
    "MixtralForCausalLM": Architecture(MoEForCausalLM, "hf", moe=True),
    "Qwen2MoeForCausalLM": Architecture(MoEForCausalLM, "hf", moe=True),
    "Qwen3MoeForCausalLM": Architecture(MoEForCausalLM, "hf", moe=True),
    "OlmoeForCausalLM": Architecture(MoEForCausalLM, "hf", moe=True),
    "llama": Architecture(LlamaForCausalLM, "gguf", moe=False),  # Llama, Mistral, SmolLM GGUFs
    "qwen2": Architecture(LlamaForCausalLM, "gguf", moe=False),  # Qwen2 / Qwen2.5 GGUFs: q/k/v biases
    "qwen3": Architecture(LlamaForCausalLM, "gguf", moe=False),  # Qwen3 GGUFs: q/k RMSNorm per head
    "llama-moe": Architecture(MoEForCausalLM, "derived", moe=True),  # GGUF llama with expert_count > 0
    "qwen2moe": Architecture(MoEForCausalLM, "gguf", moe=True),
    "qwen3moe": Architecture(MoEForCausalLM, "gguf", moe=True),
    "olmoe": Architecture(MoEForCausalLM, "gguf", moe=True),
}
MODEL_REGISTRY: dict[str, type[CausalLM]] = {name: a.model for name, a in ARCHITECTURES.items()}


def architectures(source: Literal["hf", "gguf"], moe: bool | None = None) -> tuple[str, ...]:
    """The names a checkpoint of `source` may carry (only MoE ones, or only dense ones, when `moe` is set)."""
    return tuple(n for n, a in ARCHITECTURES.items() if a.source == source and moe in (None, a.moe))


def get_model_class(architecture: str) -> type[CausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {sorted(MODEL_REGISTRY)}"
        ) from None


__all__ = [
    "ARCHITECTURES",
    "MODEL_REGISTRY",
    "Architecture",
    "CausalLM",
    "LlamaForCausalLM",
    "MoEForCausalLM",
    "ModelArchConfig",
    "architectures",
    "get_model_class",
]
