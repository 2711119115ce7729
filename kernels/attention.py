"""Paged attention: write new K/V into the block pool, then attend through block tables.

The torch reference path here is the specification: it runs everywhere (and in CPU tests); faster
backends must agree with it. `choose_backend()` is the one place that chooses a backend (pure;
`select_backend()` makes the one it names).

KV pool layout per layer (the flash-attn block-table layout):
    k, v: [num_blocks, block_size, num_kv_heads, head_dim]
A token's slot is ``block_id * block_size + offset``; slot -1 means "do not write" (padding).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# The C kernel's limits (kernels/csrc/paged_attention_cpu.c, MAX_G and MAX_D; a test holds them equal):
# past either, attention on the CPU runs on the torch reference path instead.
CPU_KERNEL_MAX_GROUP = 32  # query heads a KV head
CPU_KERNEL_MAX_HEAD_DIM = 256


@dataclass
class KVCacheLayer:
    """One layer's slice of the KV pool. Quantized pools carry per-(token, head) scales."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads] quant.SCALE_DTYPE
    v_scale: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return int(self.k.shape[1])


@dataclass
class AttentionMetadata:
    """A flat batch of T new tokens from B sequences (prefill chunks and decodes mixed)."""

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCacheLayer,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


# ---------------------------------------------------------------------------------------------
# KV storage (quantization lives in kernels/quant.py; this module only calls it)


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: KVCacheLayer, slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values [T, Hkv, D] into their slots (negative slots are padding: skipped)."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    _write_rows(k, cache.k, cache.k_scale, slot_mapping)
    _write_rows(v, cache.v, cache.v_scale, slot_mapping)


def _write_rows(x: torch.Tensor, dst: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor) -> None:
    """Write rows x [T, H, D] into their slots of one cache tensor, quantized when it has scales."""
    from kvpilot.kernels import quant

    nb, bs, h, d = dst.shape
    xq, xs = (x.to(dst.dtype), None) if scale is None else quant.quantize(x, dst.dtype)
    if xs is not None:
        assert scale is not None
        scale.view(-1, h).index_copy_(0, slots, xs)
    # raw bytes for float8: CPU index kernels do not cover it
    raw, rows = (_raw(dst), xq.view(torch.uint8)) if xq.dtype == torch.float8_e4m3fn else (dst, xq)
    if dst.is_contiguous():
        raw.view(nb * bs, h, d).index_copy_(0, slots, rows)
    else:  # tiled storage (the CPU kernel's K^T / head-major V): strided writes
        raw[slots // bs, slots % bs] = rows


def gather_kv(
    cache: KVCacheLayer, block_table: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of the blocks in `block_table` ([..., nb]) as [..., nb * block_size, Hkv, D] in `dtype`."""
    from kvpilot.kernels import quant

    # index_select, not advanced indexing: the latter is orders of magnitude slower on CPU
    idx = block_table.reshape(-1)
    if cache.k_scale is not None:
        assert cache.v_scale is not None
        # raw bytes: CPU index kernels do not cover float8
        k = _raw(cache.k).index_select(0, idx).view(cache.k.dtype)
        v = _raw(cache.v).index_select(0, idx).view(cache.v.dtype)
        k = quant.dequantize(k, cache.k_scale.index_select(0, idx), dtype)
        v = quant.dequantize(v, cache.v_scale.index_select(0, idx), dtype)
    else:
        k, v = cache.k.index_select(0, idx).to(dtype), cache.v.index_select(0, idx).to(dtype)
    shape = (*block_table.shape[:-1], block_table.shape[-1] * cache.block_size, k.shape[-2], k.shape[-1])
    return k.reshape(shape), v.reshape(shape)


def _raw(x: torch.Tensor) -> torch.Tensor:
    """A byte view of a 1-byte-element cache, any strides (CPU index kernels skip float8)."""
    return x.view(torch.uint8)


# ---------------------------------------------------------------------------------------------
# Reference backend (torch SDPA over gathered blocks)


class TorchReferenceBackend:
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCacheLayer,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, cache, meta.slot_mapping)
        if meta.decode_only:
            return self._decode(q, cache, meta, scale)
        return self._varlen(q, cache, meta, scale)

    def _decode(
        self, q: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        # q: [B, Hq, D]; one new token per sequence, so every sequence attends to its whole context.
        bs = cache.block_size
        nb = (meta.max_seq_len + bs - 1) // bs
        kk, vv = gather_kv(cache, meta.block_tables[:, :nb], q.dtype)  # [B, L, Hkv, D]
        length = kk.shape[1]
        pos = torch.arange(length, device=q.device)
        mask = pos[None, :] < meta.seq_lens[:, None].to(pos.dtype)  # [B, L]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, Hq, 1, D]
            kk.transpose(1, 2),  # [B, Hkv, L, D]
            vv.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    def _varlen(
        self, q: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        bs = cache.block_size
        start = 0
        for i, (qlen, slen) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            end = start + qlen
            if qlen == 0:
                continue
            nb = (slen + bs - 1) // bs
            kk, vv = gather_kv(cache, meta.block_tables[i, :nb], q.dtype)
            kk, vv = kk[:slen].transpose(0, 1), vv[:slen].transpose(0, 1)  # [Hkv, L, D]
            qq = q[start:end].transpose(0, 1)  # [Hq, qlen, D]
            if qlen == slen:
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True)
            else:
                # query j sits at absolute position slen - qlen + j and sees keys 0..that position
                qpos = torch.arange(slen - qlen, slen, device=q.device)
                kpos = torch.arange(slen, device=q.device)
                mask = kpos[None, :] <= qpos[:, None]
                o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o.transpose(0, 1)
            start = end
        return out


# ---------------------------------------------------------------------------------------------
# FlashAttention with block tables (CUDA, when flash-attn is importable)


# flash-attn 2 reads K/V through a block table only in pages of a multiple of 256 tokens
# ("Paged KV cache block size must be divisible by 256"); smaller blocks are packed first.
FLASH_PAGE_MULTIPLE = 256


def packed_kv(
    cache: KVCacheLayer, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every sequence's context K/V, in order, packed as [sum(seq_lens), Hkv, D], with cu_seqlens_k.

    The varlen layout flash-attn takes without a block table; one index_select per tensor.
    """
    bs = cache.block_size
    lens = meta.seq_lens.to(torch.int64)
    cu = torch.zeros(meta.num_seqs + 1, dtype=torch.int64, device=lens.device)
    cu[1:] = torch.cumsum(lens, 0)
    total = int(sum(meta.seq_lens_cpu))
    seq = torch.repeat_interleave(torch.arange(meta.num_seqs, device=lens.device), lens, output_size=total)
    pos = torch.arange(total, device=lens.device) - cu[:-1].index_select(0, seq)
    blocks = meta.block_tables.to(torch.int64)[seq, pos // bs]
    slots = blocks * bs + pos % bs
    nb, _, h, d = cache.k.shape
    k = cache.k.reshape(nb * bs, h, d).index_select(0, slots)
    v = cache.v.reshape(nb * bs, h, d).index_select(0, slots)
    return k, v, cu.to(torch.int32)


class FlashAttentionBackend:
    """flash-attn 2 on CUDA. Paged reads straight from the pool when the block size is one flash-attn
    pages by (a multiple of 256); otherwise the context is packed (packed_kv) and read as varlen."""

    name = "flash-attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        from kvpilot.kernels import triton_attention

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        # writes through the Triton store (skips slot -1 in the kernel, no host sync) where available;
        # then a paged decode step can be captured in a CUDA graph
        self._write = triton_attention.store_kv if triton_attention.available() else write_kv
        self.graph_safe = triton_attention.available()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCacheLayer,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if cache.k_scale is not None:  # quantized pools go through the reference read path
            return TorchReferenceBackend().forward(q, k, v, cache, meta, scale)
        self._write(k, v, cache, meta.slot_mapping)
        if cache.block_size % FLASH_PAGE_MULTIPLE != 0:
            kk, vv, cu_k = packed_kv(cache, meta)
            return self._varlen(
                q,
                kk,
                vv,
                cu_seqlens_q=meta.query_start_loc,
                cu_seqlens_k=cu_k,
                max_seqlen_q=meta.max_query_len,
                max_seqlen_k=meta.max_seq_len,
                softmax_scale=scale,
                causal=True,  # bottom-right aligned: each new token sees its cached context
            )
        if meta.decode_only:
            out = self._with_kvcache(
                q.unsqueeze(1),
                cache.k,
                cache.v,
                cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables,
                softmax_scale=scale,
                causal=True,
            )
            return out.squeeze(1)
        cu_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=q.device)
        cu_k[1:] = torch.cumsum(meta.seq_lens, 0)
        return self._varlen(
            q,
            cache.k,
            cache.v,
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=cu_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_tables,
        )


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def flash_pages(block_size: int) -> bool:
    """Whether flash-attn's paged kernel reads a pool of this block size in place."""
    return block_size % FLASH_PAGE_MULTIPLE == 0


FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash-attn 2 computes in these only


def cuda_backend_name(kv_dtype: torch.dtype, block_size: int, have_flash: bool, have_triton: bool) -> str:
    """Pure: which CUDA backend runs a pool of `kv_dtype` (its storage dtype). flash-attn where it pages
    the pool in place (float16/bfloat16 pools, blocks of a multiple of 256); the Triton kernel for
    everything else: int8/fp8 and float32 pools, other block sizes (no per-step packing copy);
    flash-attn's packed path, then the torch reference, only when Triton is missing."""
    flash_reads = have_flash and kv_dtype in FLASH_DTYPES
    if flash_reads and flash_pages(block_size):
        return "flash-attn"
    if have_triton:
        return "triton"
    if flash_reads:
        return "flash-attn"
    return "torch"


@dataclass(frozen=True)
class Installed:
    """What this process can run attention with besides torch (`installed` probes it)."""

    flash_attn: bool = False  # flash-attn importable and a CUDA device present
    triton: bool = False  # the Triton paged kernel (CUDA)
    cpu_kernel: bool = False  # the C paged-attention kernel built at the selected ISA level


def installed(device_type: str) -> Installed:
    """Probe what `device_type` can run (on CPU this builds the C kernel for the selected ISA level)."""
    if device_type == "cuda":
        from kvpilot.kernels import triton_attention

        return Installed(flash_attn=flash_attn_available(), triton=triton_attention.available())
    if device_type == "cpu":
        from kvpilot.kernels import cpu_attention

        return Installed(cpu_kernel=cpu_attention.available())
    return Installed()


@dataclass(frozen=True)
class Heads:
    """A model's attention heads as a kernel sees them: query heads a KV head, and the head size."""

    group: int
    head_dim: int


def cpu_kernel_takes(heads: Heads | None) -> bool:
    """Pure: whether the C kernel runs these heads at all (None: not known, assumed so)."""
    return heads is None or (
        heads.group <= CPU_KERNEL_MAX_GROUP and heads.head_dim <= CPU_KERNEL_MAX_HEAD_DIM
    )


def choose_backend(
    device_type: str,
    kv_dtype: torch.dtype,
    block_size: int,
    have: Installed,
    cpu_kernels: bool = True,
    heads: Heads | None = None,
) -> str:
    """Pure: the name of the backend attention runs on, the one choice every caller makes through
    (`select_backend`; the runner's CPU decoder stack and the block size follow from it).
    `kv_dtype`: the pool's storage dtype; `cpu_kernels`: the kernel switch (kernels/switches.py);
    `heads`: the model's, where known (heads past the C kernel's limits run on torch)."""
    if device_type == "cuda":
        return cuda_backend_name(kv_dtype, block_size, have.flash_attn, have.triton)
    if device_type == "cpu" and cpu_kernels and have.cpu_kernel and cpu_kernel_takes(heads):
        return "cpu-paged"
    return "torch"


def flash_reads_in_place(device_type: str, kv_dtype: torch.dtype, have: Installed) -> bool:
    """Pure: whether flash-attn would page a pool of `kv_dtype` in place at a block size of
    FLASH_PAGE_MULTIPLE (what the default block size follows: runtime/engine/plan.py)."""
    return choose_backend(device_type, kv_dtype, FLASH_PAGE_MULTIPLE, have) == "flash-attn"


def select_backend(
    device: torch.device,
    kv_quantized: bool = False,
    block_size: int = 16,
    kv_dtype: torch.dtype | None = None,
    heads: Heads | None = None,
) -> AttentionBackend:
    """The backend `choose_backend` names for this device and pool, made (`kv_dtype`: the pool's
    storage dtype; on CUDA it decides whether flash-attn can read it; `heads`: the model's)."""
    from kvpilot.kernels import switches

    dtype = kv_dtype if kv_dtype is not None else (torch.int8 if kv_quantized else torch.float16)
    have, enabled = installed(device.type), switches.current().cpu_kernels
    name = choose_backend(device.type, dtype, block_size, have, enabled, heads)
    if (
        device.type == "cpu"
        and enabled
        and have.cpu_kernel
        and heads is not None
        and not cpu_kernel_takes(heads)
    ):
        log.warning(
            "CPU attention: %d query heads a KV head, head_dim %d are past the C kernel's limits (at most %d "
            "and %d): attention runs on torch's reference path, several times slower",
            heads.group,
            heads.head_dim,
            CPU_KERNEL_MAX_GROUP,
            CPU_KERNEL_MAX_HEAD_DIM,
        )
    if name == "flash-attn":
        return FlashAttentionBackend()
    if name == "triton":
        from kvpilot.kernels import triton_attention

        return triton_attention.TritonPagedAttentionBackend()
    if name == "cpu-paged":
        from kvpilot.kernels import cpu_attention

        return cpu_attention.CPUPagedAttentionBackend()
    return TorchReferenceBackend()


class PagedAttention(torch.nn.Module):
    """What a model's attention layer calls: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCacheLayer,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        return backend.forward(q, k, v, cache, meta, self.scale)


def model_heads(model: Any) -> Heads | None:
    """The heads of a model's attention layers (its first PagedAttention; None where it has none)."""
    for m in model.modules():
        if isinstance(m, PagedAttention):
            return Heads(group=max(1, m.num_heads // max(1, m.num_kv_heads)), head_dim=m.head_dim)
    return None
