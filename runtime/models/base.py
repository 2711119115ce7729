"""The interface every causal LM here implements; the model runner calls exactly these methods."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvpilot.kernels.attention import AttentionBackend, AttentionMetadata, KVCacheLayer
from kvpilot.kernels.qlinear import QuantizedWeight


class CausalLM(nn.Module):
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCacheLayer],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch of T tokens (input_ids and positions are [T]);
        with `logit_rows` (distinct row indices) only those rows, in that order: a model may then
        skip work no other row needs (its last layer past attention), every row's K/V still cached."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (select the rows to sample from before calling)."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Load (HF parameter name, full tensor) pairs; each parameter keeps its own shard. A
        QuantizedWeight goes to a layer prepared for it (runtime/quantization.prepare_blocks)."""
        raise NotImplementedError
