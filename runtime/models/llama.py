"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

One class covers the family: the differences are configuration (q/k/v bias for Qwen2, tied
embeddings for SmolLM, rope scaling for Llama 3.x). The forward pass takes a flat batch of T tokens
from any mix of prefill chunks and decodes; attention goes through `PagedAttention`, which writes the
new K/V into the block pool and reads each sequence's context through its block table.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kvpilot.kernels.attention import AttentionBackend, AttentionMetadata, KVCacheLayer, PagedAttention
from kvpilot.kernels.qlinear import QuantizedWeight
from kvpilot.runtime.models.arch_config import ModelArchConfig
from kvpilot.runtime.models.base import CausalLM
from kvpilot.runtime.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    get_weight_loader,
)
from kvpilot.runtime.models.parallel import get_tp_world_size, tp_all_reduce

# checkpoint (HF) name piece -> (our fused parameter piece, shard id)
PACKED_MODULES: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

# Checkpoint entries that are derived state, not weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

# llama.cpp's `rope_freqs` tensor (Llama 3.1 GGUFs), under the name the GGUF reader gives it.
ROPE_FREQS_NAME = "model.rotary_emb.freq_factors"


def last_layer_rows(logit_rows: torch.Tensor | None, num_tokens: int) -> torch.Tensor | None:
    """Pure: the rows the last layer carries past attention, or None for all of them (no
    `logit_rows`, or as many as the batch has: the runner's sample rows are distinct)."""
    if logit_rows is None or logit_rows.numel() == num_tokens:
        return None
    return logit_rows


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, bias=cfg.qkv_bias
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.rotary_emb = rotary  # one module shared by every layer (one cos/sin table)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KVCacheLayer,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; with `keep`, every row's K/V still goes into the cache but
        only the rows in `keep` (in that order) go through o_proj and come back."""
        t = hidden.shape[0]
        q, k, v = self.project_qkv(hidden)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, kv_cache, meta, backend).reshape(t, self.num_heads * self.head_dim)
        if keep is not None:
            if not keep.numel():  # nothing past the cache writes
                return hidden.new_empty((0, hidden.shape[1]))
            out = out.index_select(0, keep)
        return self.o_proj(out)

    def project_qkv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, q_size], k and v [T, kv_size]: families with q/k norms or clipping override this."""
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size, size], bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


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


class QKNormAttention(LlamaAttention):
    """Llama attention plus the optional q/k RMSNorm (per head: Qwen3 and Qwen3-MoE; over the whole
    projection: OLMoE) and qkv clipping (OLMoE)."""

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


def attention_for(cfg: ModelArchConfig, rotary: RotaryEmbedding) -> LlamaAttention:
    """A decoder layer's attention: QKNormAttention where the family norms or clips q/k, else Llama's."""
    if cfg.qk_norm is not None or cfg.clip_qkv is not None:
        return QKNormAttention(cfg, rotary)
    return LlamaAttention(cfg, rotary)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = attention_for(cfg, rotary)
        self.mlp: nn.Module = LlamaMLP(cfg)  # MoE decoders put a sparse MoE block here
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCacheLayer,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output delta, running residual); the caller adds them lazily.
        `keep`: only these rows past attention (the model's last layer, see LlamaModel.forward)."""
        x, residual = self.input_layernorm(hidden, residual)
        x = self.self_attn(positions, x, kv_cache, meta, backend, keep)
        if keep is not None:
            residual = residual.index_select(0, keep)
            if not keep.numel():
                return x, residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, self.rotary_emb) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCacheLayer],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden], or with `logit_rows` those rows only, in that order.

        The rows nobody samples from need the last layer for their K/V alone: with `logit_rows` the
        last layer writes every row's K/V, then runs o_proj and the MLP (the experts, in a MoE
        model) on the logit rows only, which saves a 1/num_layers share of a prefill's work."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"got {len(kv_caches)} KV cache layers for a model with {len(self.layers)} layers"
            )
        hidden = self.embed_tokens(input_ids)
        keep = last_layer_rows(logit_rows, hidden.shape[0])
        residual: torch.Tensor | None = None
        last = len(self.layers) - 1
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            rows = keep if i == last else None
            hidden, residual = layer(positions, hidden, residual, cache, meta, backend, rows)
        return self.final_norm(hidden, residual)

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The final RMSNorm of the last layer's output plus the residual (an empty batch as it is)."""
        if not hidden.shape[0]:
            return hidden
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCacheLayer],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch of T tokens (input_ids and positions are [T]),
        or [len(logit_rows), hidden] for those rows (LlamaModel.forward)."""
        return self.model(input_ids, positions, kv_caches, meta, backend, logit_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (pick the rows to sample from before calling)."""
        return self.lm_head.compute_logits(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Load (HF name, full tensor) pairs; each parameter's weight_loader keeps this rank's shard.

        Raises ValueError naming unknown checkpoint entries or parameters the checkpoint left unset.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name == ROPE_FREQS_NAME:
                assert isinstance(tensor, torch.Tensor)
                self.model.rotary_emb.set_freq_factors(tensor)
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints store a copy of the embedding; the embedding wins
            target, shard_id = self.map_name(name)
            if target not in params:
                unexpected.append(name)
                continue
            param = params[target]
            get_weight_loader(param)(param, tensor, shard_id)
            loaded.add(target)
        _check_complete(params, loaded, unexpected)

    def map_name(self, name: str) -> tuple[str, Any]:
        """Checkpoint name -> (our parameter name, the shard id its weight_loader takes)."""
        return _map_name(name)


def _map_name(name: str) -> tuple[str, str | int | None]:
    for piece, (fused, shard_id) in PACKED_MODULES.items():
        if f".{piece}." in name:
            return name.replace(f".{piece}.", f".{fused}."), shard_id
    return name, None


def _check_complete(params: dict[str, nn.Parameter], loaded: set[str], unexpected: list[str]) -> None:
    # named_parameters() lists a tied parameter once, under its first name (the embedding).
    missing = sorted(set(params) - loaded)
    if unexpected or missing:
        parts = []
        if unexpected:
            parts.append(
                f"unexpected checkpoint tensors: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
            )
        if missing:
            parts.append(
                f"parameters missing from the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
            )
        raise ValueError("; ".join(parts))
