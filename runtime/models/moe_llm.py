"""Mixture-of-Experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

They are the Llama decoder with the MLP replaced by a sparse MoE block (runtime/models/moe.py), and
the per-family differences are configuration:
- Mixtral: top-k renormalized always; sliding-window attention is handled as for Mistral.
- Qwen2-MoE: q/k/v bias, `norm_topk_prob`, a shared expert scaled by sigmoid(shared_expert_gate(x)),
  dense MLP layers where `mlp_only_layers` / `decoder_sparse_step` say so.
- Qwen3-MoE: RMSNorm on each query and key head before rotary (`q_norm` / `k_norm` of head_dim),
  `norm_topk_prob`, dense layers as Qwen2-MoE.
- OLMoE: RMSNorm over the whole q and k projections (all heads at once, so under tensor parallelism
  the sum of squares is all-reduced), optional `clip_qkv`, top-k not renormalized by default.

Checkpoint names: `mlp.experts.{e}.{gate,up,down}_proj.weight` (Qwen, OLMoE) and
`block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` (Mixtral) load into each layer's stacked
`mlp.experts.w13` / `mlp.experts.w2` with shard id (expert, piece).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from kvpilot.runtime.models.arch_config import ModelArchConfig
from kvpilot.runtime.models.base import CausalLM
from kvpilot.runtime.models.layers import ParallelLMHead, RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from kvpilot.runtime.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    attention_for,
)
from kvpilot.runtime.models.moe import SparseMoeBlock

# checkpoint expert piece -> ours (w1 gate, w3 up, w2 down)
_EXPERT_PIECES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}
_EXPERT_NAME = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


class MoEDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = attention_for(cfg, rotary)
        if layer_idx in cfg.dense_mlp_layers:
            self.mlp = LlamaMLP(cfg)
        else:
            self.mlp = SparseMoeBlock(
                cfg.hidden_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.moe_intermediate_size,
                cfg.norm_topk_prob,
                cfg.shared_expert_intermediate_size,
            )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MoEModel(LlamaModel):
    def __init__(self, cfg: ModelArchConfig) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(
            MoEDecoderLayer(cfg, self.rotary_emb, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MoEForCausalLM(LlamaForCausalLM):
    """Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (one class; the differences are configuration)."""

    def __init__(self, cfg: ModelArchConfig) -> None:
        if not cfg.is_moe:
            raise ValueError(f"{cfg.architecture}: a Mixture-of-Experts model needs num_experts > 0")
        CausalLM.__init__(self)
        self.config = cfg
        self.model = MoEModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def map_name(self, name: str) -> tuple[str, Any]:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if m := _EXPERT_NAME.search(name):
            piece = _EXPERT_PIECES[m.group(2)]
            target = f"{name[: m.start()]}.mlp.experts.{'w2' if piece == 'w2' else 'w13'}"
            return target, (int(m.group(1)), piece)
        return super().map_name(name)
