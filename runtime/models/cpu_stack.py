"""Which Llama-family models run their decoder layers in one C call on the CPU: a compiled forward
the runner picks (runtime/engine/runner.py), as it picks CUDA graphs on a GPU.

A decode step of a small model on a CPU spends more time dispatching ~15 torch ops and kernel calls
per layer from Python than in the arithmetic (docs/benchmarks.md, "Decode step out of Python"):
kernels/cpu_decoder.py runs the whole stack of layers in one call, through the same kernels the
layers call. `compile_stack` gives the runner a `CompiledStack` when every layer is exactly the Llama
layer (no family override of its projections, norms or MLP), every linear weight is quantized in
the CPU kernel's tiled layout without LoRA, tensor parallelism or an input permutation, the
attention backend is the CPU kernel's and the KV cache in the activations' dtype, bfloat16, or quantized
(int8 / fp8 with float16 scales: --kv-cache-dtype; cpu_ops.write_kv_ rounds or quantizes in C); the runner
then sends it the steps it `fits`: every step whose rows the Python layers' matmuls would give the
same tiled kernel (qlinear.max_kernel_rows: a decode batch of any usual size, and prefill chunks up to
that bound), so the two run the same kernels and give the same hidden states. Longer steps run the
model's own forward, which stays the reference (tests compare the two).

The `cpu_decoder_stack` kernel switch (--no-cpu-decoder-stack, KVPILOT_CPU_DECODER_STACK=0;
kernels/switches.py) turns it off (benchmarks compare the two).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from kvpilot.kernels import cpu_attention, cpu_decoder, cpu_ops, qlinear
from kvpilot.kernels.attention import AttentionBackend, AttentionMetadata, KVCacheLayer
from kvpilot.runtime.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    QKNormAttention,
    last_layer_rows,
)

OFF = "the cpu_decoder_stack switch is off (--no-cpu-decoder-stack or KVPILOT_CPU_DECODER_STACK=0)"


def linears(layer: LlamaDecoderLayer) -> tuple[Any, Any, Any, Any]:
    """A Llama layer's four linear modules, in the stack's order."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def unsupported(model: LlamaModel) -> str | None:
    """Why the model's layers cannot run as one C stack (None when they can)."""
    if not cpu_decoder.available():
        return "the CPU kernels are unavailable or have no tiled quantized path here"
    for layer in model.layers:
        if type(layer) is not LlamaDecoderLayer:
            return f"layer type {type(layer).__name__}"
        attn, mlp = layer.self_attn, layer.mlp
        if type(mlp) is not LlamaMLP:
            return f"MLP {type(mlp).__name__}"
        if type(attn) is QKNormAttention:  # the stack norms each q/k head (Qwen3), not OLMoE's norm or clip
            if attn.qk_norm != "head" or attn.clip_qkv is not None:
                return f"q/k norm {attn.qk_norm!r} with clip_qkv {attn.clip_qkv}"
        elif type(attn) is not LlamaAttention:
            return f"attention {type(attn).__name__}"
        for lin in linears(layer):
            qw = lin.qweight
            if qw is None or not qw.tiled:
                return "a linear weight not quantized in the tiled layout"
            if lin.lora is not None or lin.input_perm is not None or lin.tp_size != 1:
                return "LoRA, an input permutation or tensor parallelism"
    return None


def unsupported_step(
    dtype: torch.dtype, device: torch.device, kv_caches: list[KVCacheLayer], backend: AttentionBackend
) -> str | None:
    """Pure: why steps of activations in `dtype` on `device`, with this KV pool and attention backend,
    cannot take the stack (None when they can)."""
    first = kv_caches[0]
    if backend.name != cpu_attention.CPUPagedAttentionBackend.name:
        return f"attention backend {backend.name}"
    if device.type != "cpu" or dtype not in cpu_decoder.DTYPES:
        return f"activations {dtype} on {device.type}"
    quantized = first.k.dtype in cpu_ops.QUANTIZED and first.k_scale is not None
    if first.v.dtype != first.k.dtype or not (
        quantized or (first.k_scale is None and first.k.dtype in (dtype, torch.bfloat16))
    ):
        return f"a {first.k.dtype} KV cache for {dtype} activations"
    return None


def compile_stack(
    model: Any, kv_caches: list[KVCacheLayer], backend: AttentionBackend, enabled: bool
) -> tuple[CompiledStack | None, str]:
    """The runner's compiled forward for `model` with this KV pool and backend, or None and why not."""
    if not enabled:
        return None, OFF
    inner = getattr(model, "model", None)
    if type(model) is not LlamaForCausalLM or type(inner) is not LlamaModel:
        return None, f"model class {type(model).__name__}"
    assert isinstance(inner, LlamaModel)
    why = unsupported(inner)
    if why is None:
        # the activations' dtype: the rows the embedding hands out (a quantized table has no weight)
        probe = inner.embed_tokens(torch.zeros(1, dtype=torch.int64, device=kv_caches[0].k.device))
        why = unsupported_step(probe.dtype, probe.device, kv_caches, backend)
    if why is not None:
        return None, why
    stack = CompiledStack(inner)
    return stack, f"one C call for steps of at most {stack.max_tokens()} tokens"


class CompiledStack:
    """LlamaForCausalLM's forward with the decoder layers in one C call (the same hidden states)."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.stack = CpuDecoderStack(model)
        # one weight per bit width: what qlinear.max_kernel_rows reads of a tiled weight
        layers: list[Any] = list(model.layers)
        self.kinds = list(
            {lin.qweight.bits: lin.qweight for layer in layers for lin in linears(layer)}.values()
        )

    def max_tokens(self) -> int:
        """The most tokens of a step the stack takes: the fewest rows any of its weights gives the tiled
        kernel in the Python layers under the current switches (qlinear.max_kernel_rows), so both run
        the same kernels; past it their matmuls take the GEMM or torch."""
        return min(qlinear.max_kernel_rows(qw) for qw in self.kinds)

    def fits(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` takes the stack (more than max_tokens, a long prefill: the
        model's layers)."""
        return 0 < num_tokens <= self.max_tokens()

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCacheLayer],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As LlamaModel.forward: final hidden states [T, hidden], or those of `logit_rows`."""
        hidden = self.model.embed_tokens(input_ids)
        hidden, residual = self.stack.forward(hidden, positions, kv_caches, meta)  # one C call
        keep = last_layer_rows(logit_rows, hidden.shape[0])
        if keep is not None:
            hidden, residual = hidden.index_select(0, keep), residual.index_select(0, keep)
        return self.model.final_norm(hidden, residual)


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

    def layers(self, kv_caches: list[KVCacheLayer], dtype: torch.dtype) -> ctypes.Array[cpu_decoder.Layer]:
        scales = [0 if s is None else s.data_ptr() for c in kv_caches for s in (c.k_scale, c.v_scale)]
        key = (*(c.k.data_ptr() for c in kv_caches), *(c.v.data_ptr() for c in kv_caches), *scales, id(dtype))
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
            if getattr(attn, "q_norm", None) is not None:  # Qwen3's per-head q/k norms (unsupported() checks)
                (entry.q_norm, entry.qk_eps), (entry.k_norm, _) = norm(attn.q_norm), norm(attn.k_norm)
            entry.gate_up, entry.down = lin(mlp.gate_up_proj), lin(mlp.down_proj)
            entry.k_cache, entry.v_cache = cache.k.data_ptr(), cache.v.data_ptr()
            entry.k_strides[:] = list(cache.k.stride())
            entry.v_strides[:] = list(cache.v.stride())
            entry.k_scale = None if cache.k_scale is None else cache.k_scale.data_ptr()
            entry.v_scale = None if cache.v_scale is None else cache.v_scale.data_ptr()
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
            rotary.rotary_dim, cpu_ops.DTYPE_CODES[cache.k.dtype], int(cpu_attention.k_transposed(cache.k)),
            int(cpu_attention.v_head_major(cache.v)), int(block_size), int(tables.shape[1]), meta.num_seqs,
            torch.get_num_threads(), 1, int(cache.k.shape[0]) * int(block_size), int(table.shape[0]),
            first_attn.attn.scale, pos.data_ptr(), slots.data_ptr(), table.data_ptr(), tables.data_ptr(),
            qsl.data_ptr(), lens.data_ptr(),
        )  # fmt: skip
        out = hidden.contiguous()  # the embedding lookup's fresh tensor: overwritten in place
        residual = torch.empty_like(out)
        cpu_decoder.run(step, self.layers(kv_caches, hidden.dtype), out, residual)
        return out, residual
