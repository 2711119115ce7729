"""The architecture hyperparameters a model is built from, whatever file format they came from.

The loader fills this from GGUF metadata (`llama.embedding_length`, ...) or from a Hugging Face
`config.json`; models read nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelArchConfig:
    architecture: str  # registry key: "LlamaForCausalLM", "Qwen2ForCausalLM", "llama" (GGUF), ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope scaling parameters ({"rope_type": "llama3" | "linear", "factor": ..., ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections only
    o_bias: bool = False  # Llama `attention_bias=True` puts a bias on o_proj too
    mlp_bias: bool = False
    sliding_window: int | None = None  # None: full attention
    extra: dict[str, Any] = field(default_factory=dict)  # format-specific leftovers, for diagnostics

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim
