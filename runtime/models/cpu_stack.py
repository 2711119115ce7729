"""Which Llama-family models and steps run their decoder layers in one C call on the CPU.

A decode step of a small model on a CPU spends more time dispatching ~15 torch ops and kernel calls
per layer from Python than in the arithmetic (docs/benchmarks.md, "Decode step out of Python"):
kernels/cpu_decoder.py runs the whole stack of layers in one call, through the same kernels the
layers call. It applies when every layer is exactly the Llama layer (no family override of its
projections, norms or MLP), every linear weight is quantized in the CPU kernel's tiled layout
without LoRA, tensor parallelism or an input permutation, the step has at most qlinear.SMALL_M
tokens in float32 or bfloat16, and the KV cache is the CPU backend's unquantized one. Everything
else runs the Python layers, which stay the reference (tests compare the two).

KVPILOT_CPU_DECODER_STACK=0 turns it off (benchmarks compare the two); any other value than 0 or 1
is refused naming the variable.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvpilot.kernels import cpu_attention, cpu_decoder, env, qlinear
from kvpilot.kernels.attention import AttentionBackend, AttentionMetadata, KVCacheLayer

if TYPE_CHECKING:
    from kvpilot.runtime.models.llama import LlamaModel

ENV = "KVPILOT_CPU_DECODER_STACK"


def enabled(value: str | None) -> bool:
    """KVPILOT_CPU_DECODER_STACK: unset or 1 (the default: on where it applies), or 0 (off)."""
    return env.switch(ENV, value, {"0": False, "1": True})


ENABLED = enabled(os.environ.get(ENV))


def unsupported(model: LlamaModel) -> str | None:
    """Why the model's layers cannot run as one C stack (None when they can)."""
    from kvpilot.runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    if not ENABLED:
        return f"{ENV}=0"
    if not cpu_decoder.available():
        return "the CPU kernels are unavailable or have no tiled quantized path here"
    for layer in model.layers:
        if type(layer) is not LlamaDecoderLayer:
            return f"layer type {type(layer).__name__}"
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
            return f"attention {type(attn).__name__} / MLP {type(mlp).__name__}"
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            qw = lin.qweight
            if qw is None or not qw.tiled:
                return "a linear weight not quantized in the tiled layout"
            if lin.lora is not None or lin.input_perm is not None or lin.tp_size != 1:
                return "LoRA, an input permutation or tensor parallelism"
    return None


@dataclass
class _Layers:
    key: tuple[int, ...]  # the KV cache storage it was built for
    array: ctypes.Array[cpu_decoder.Layer]
    keep: list[torch.Tensor]  # biases converted to the activations' dtype, kept alive


class CpuDecoderStack:
    """One model's layers as the C stack's structs (weights once; KV pointers per cache)."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.kernels = cpu_decoder.kernels()
        self._layers: _Layers | None = None

    @classmethod
    def for_model(cls, model: LlamaModel) -> CpuDecoderStack | None:
        """The model's stack, built on first use (None when unsupported: checked once)."""
        cached = model.__dict__.get("_cpu_stack", False)
        if cached is False:
            cached = cls(model) if unsupported(model) is None else None
            model.__dict__["_cpu_stack"] = cached
        return cached

    def applies(self, hidden: torch.Tensor, kv_caches: list[KVCacheLayer], backend: AttentionBackend) -> bool:
        first = kv_caches[0]
        return (
            isinstance(backend, cpu_attention.CPUPagedAttentionBackend)
            and hidden.device.type == "cpu"
            and hidden.dtype in cpu_decoder.DTYPES
            and 0 < hidden.shape[0] <= qlinear.SMALL_M
            and first.k_scale is None
            and first.k.dtype == hidden.dtype
            and first.v.dtype == hidden.dtype
        )

    def layers(self, kv_caches: list[KVCacheLayer], dtype: torch.dtype) -> ctypes.Array[cpu_decoder.Layer]:
        key = (*(c.k.data_ptr() for c in kv_caches), *(c.v.data_ptr() for c in kv_caches), id(dtype))
        if self._layers is None or self._layers.key != key:
            self._layers = self._build(kv_caches, dtype, key)
        return self._layers.array

    def _build(self, kv_caches: list[KVCacheLayer], dtype: torch.dtype, key: tuple[int, ...]) -> _Layers:
        keep: list[torch.Tensor] = []

        def lin(module: Any) -> cpu_decoder.Linear:
            bias = None if module.bias is None else module.bias.to(dtype).contiguous()
            if bias is not None:
                keep.append(bias)
            return cpu_decoder.linear(module.qweight, bias)

        def norm(module: Any) -> tuple[int, float]:
            weight = module.weight.to(dtype).contiguous()
            keep.append(weight)
            return weight.data_ptr(), float(module.eps)

        array = (cpu_decoder.Layer * len(self.model.layers))()
        layers: list[Any] = list(self.model.layers)
        for entry, layer, cache in zip(array, layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            (entry.norm1, entry.eps1), (entry.norm2, entry.eps2) = (
                norm(layer.input_layernorm),
                norm(layer.post_attention_layernorm),
            )
            entry.qkv, entry.o = lin(attn.qkv_proj), lin(attn.o_proj)
            entry.gate_up, entry.down = lin(mlp.gate_up_proj), lin(mlp.down_proj)
            entry.k_cache, entry.v_cache = cache.k.data_ptr(), cache.v.data_ptr()
            entry.k_strides[:] = list(cache.k.stride())
            entry.v_strides[:] = list(cache.v.stride())
        return _Layers(key, array, keep)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCacheLayer],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(last layer's output, running residual) for embeddings hidden [T, H]: the Python loop's."""
        first_attn: Any = self.model.layers[0].self_attn
        rotary = first_attn.rotary_emb
        cache = kv_caches[0]
        pos = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        tables = meta.block_tables.contiguous()
        qsl, lens = meta.query_start_loc.contiguous(), meta.seq_lens.contiguous()
        table = rotary.cos_sin_cache
        if table.dtype != torch.float32 or not table.is_contiguous():
            table = table.to(torch.float32).contiguous()
        _, block_size, num_kv_heads, head_dim = cache.k.shape
        k = self.kernels
        step = cpu_decoder.Step(
            k["rms_norm"], k["rotary"], k["write_kv"], k["attention"], k["silu_mul"], k["qmatmul"],
            cpu_decoder.DTYPES[hidden.dtype], first_attn.num_heads, int(num_kv_heads), int(head_dim),
            rotary.rotary_dim, cpu_decoder.DTYPES[hidden.dtype], int(cpu_attention.k_transposed(cache.k)),
            int(cpu_attention.v_head_major(cache.v)), int(block_size), int(tables.shape[1]), meta.num_seqs,
            torch.get_num_threads(), 1, int(cache.k.shape[0]) * int(block_size), int(table.shape[0]),
            first_attn.attn.scale, pos.data_ptr(), slots.data_ptr(), table.data_ptr(), tables.data_ptr(),
            qsl.data_ptr(), lens.data_ptr(),
        )  # fmt: skip
        out = hidden.contiguous()  # the embedding lookup's fresh tensor: overwritten in place
        residual = torch.empty_like(out)
        cpu_decoder.run(step, self.layers(kv_caches, hidden.dtype), out, residual)
        return out, residual
