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

import torch
from torch import nn

from kvpilot.runtime.models.arch_config import ModelArchConfig
from kvpilot.runtime.models.base import CausalLM
from kvpilot.runtime.models.layers import ParallelLMHead, RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from kvpilot.runtime.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from kvpilot.runtime.models.moe import SparseMoeBlock
from kvpilot.runtime.models.parallel import get_tp_world_size, tp_all_reduce

# checkpoint expert piece -> ours (w1 gate, w3 up, w2 down)
_EXPERT_PIECES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}
_EXPERT_NAME = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a vector split across tensor-parallel ranks (OLMoE's q/k norm spans all heads).

    This rank holds `shard_size` values (block `shard_index` of the full vector); the sum of squares
    is all-reduced, and divided by `replicas` when each block lives on that many ranks (KV heads
    replicated because there are fewer of them than ranks).
    """

    def __init__(self, full_size: int, shard_size: int, eps: float, shard_index: int, replicas: int) -> None:
        super().__init__()
        self.full_size = full_size
        self.shard_index = shard_index
        self.replicas = replicas
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(shard_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if loaded_weight.shape != (self.full_size,):
            raise ValueError(
                f"shape mismatch: norm of {self.full_size}, checkpoint {tuple(loaded_weight.shape)}"
            )
        size = param.shape[0]
        param.data.copy_(loaded_weight.narrow(0, self.shard_index * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        if get_tp_world_size() == 1:
            variance = h.pow(2).mean(-1, keepdim=True)
        else:
            variance = tp_all_reduce(h.pow(2).sum(-1, keepdim=True)) / (self.full_size * self.replicas)
        return self.weight * (h * torch.rsqrt(variance + self.eps)).to(dtype)


class MoEAttention(LlamaAttention):
    """Llama attention plus the optional q/k RMSNorm (per head or whole-projection) and qkv clipping."""

    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, rotary)
        self.qk_norm = cfg.qk_norm
        self.clip_qkv = cfg.clip_qkv
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        p = self.qkv_proj
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm = ShardedRMSNorm(cfg.q_size, p.q_size, cfg.rms_norm_eps, p.tp_rank, 1)
            self.k_norm = ShardedRMSNorm(
                cfg.kv_size, p.kv_size, cfg.rms_norm_eps, p.tp_rank // p.kv_replicas, p.kv_replicas
            )
        elif cfg.qk_norm is not None:
            raise ValueError(f"qk_norm must be None, 'head' or 'full', got {cfg.qk_norm!r}")

    def project_qkv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Llama's projection, then OLMoE's whole-projection norm, its clipping, or Qwen3's per-head norm."""
        q, k, v = super().project_qkv(hidden)
        if self.qk_norm == "full":
            assert self.q_norm is not None and self.k_norm is not None
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        if self.qk_norm == "head":
            assert isinstance(self.q_norm, RMSNorm) and isinstance(self.k_norm, RMSNorm)
            t, d = hidden.shape[0], self.head_dim
            q = self.q_norm(q.reshape(t * self.num_heads, d))[0].reshape(t, -1)
            k = self.k_norm(k.reshape(t * self.num_kv_heads, d))[0].reshape(t, -1)
        return q, k, v


class MoEDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = MoEAttention(cfg, rotary)
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
