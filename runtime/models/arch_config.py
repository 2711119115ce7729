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
    # Mixture of experts (num_experts == 0: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each routed expert's width
    norm_topk_prob: bool = False  # renormalize the top-k routing weights (Mixtral: always)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert (0: none)
    dense_mlp_layers: tuple[int, ...] = ()  # layers with a dense MLP of intermediate_size (Qwen MoE)
    qk_norm: str | None = None  # RMSNorm on q and k: "head" (Qwen3, per head) or "full" (OLMoE, whole q/k)
    clip_qkv: float | None = None  # OLMoE: clamp q, k, v to [-clip, clip]
    extra: dict[str, Any] = field(default_factory=dict)  # format-specific leftovers, for diagnostics

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim
