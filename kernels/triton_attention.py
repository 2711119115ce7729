"""Paged attention in Triton: one kernel for prefill chunks, mixed batches and decode.

The CUDA backend for what flash-attn cannot do (quantized KV pools, block sizes that are not a
multiple of 256) and the default where flash-attn is not installed. It agrees with the torch
reference backend (kernels/attention.py, the specification); tests run it on the CPU under Triton's
interpreter (`TRITON_INTERPRET=1`).

Layout (see kernels/attention.py): k, v [num_blocks, block_size, Hkv, D], any strides; quantized
pools carry k_scale, v_scale [num_blocks, block_size, Hkv] float16 and are dequantized inside the
kernel (value * scale, in float32).

One program handles one sequence, one KV head and a tile of BLOCK_Q query tokens; its BLOCK_M rows
are (token, query head of the group) pairs, so a GQA group reads each K/V tile once and decode (one
token) still fills the tile with the group's heads. Keys are walked BLOCK_N positions at a time through
the block table, so any block size works; the causal limit is each query's absolute position
(seq_len - query_len + j). Online softmax in float32. Decode steps over long contexts split the
context across programs (SPLIT_KEYS keys each) and combine the partial softmax results after.

Writes go through `store_kv`, which skips slot -1 inside the kernel (no host sync: CUDA-graph safe).
"""

from __future__ import annotations

import torch

from kvpilot.kernels import quant
from kvpilot.kernels.attention import AttentionMetadata, KVCacheLayer

try:  # triton ships with torch on Linux; absent elsewhere (macOS wheels)
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    HAVE_TRITON = False


def available() -> bool:
    return HAVE_TRITON


BLOCK_N = 32  # key positions per inner step
MIN_ROWS = 16  # tl.dot needs at least 16 rows


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tile_shape(group: int, max_query_len: int) -> tuple[int, int, int]:
    """(BLOCK_Q query tokens, G_PAD heads per token, BLOCK_M rows) for a GQA group of `group` heads."""
    g_pad = _next_pow2(group)
    # decode: the group's heads fill a 16-row tile; prefill: 64 rows of (token, head)
    block_q = max(1, (MIN_ROWS if max_query_len == 1 else 64) // g_pad)
    return block_q, g_pad, max(MIN_ROWS, block_q * g_pad)


if HAVE_TRITON:

    @triton.jit
    def _store_kv_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: arguments are typed by the JIT
        src_ptr,
        dst_ptr,
        slot_ptr,
        row_elems,
        stride_src_t,
        stride_dst_b,
        stride_dst_t,
        block_size,
        BLOCK: tl.constexpr,
    ):
        # one token's [H, D] row (or [H] scales) into its slot; slot < 0 is padding: nothing written
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            blk = slot // block_size
            off = slot % block_size
            for start in range(0, row_elems, BLOCK):
                i = start + tl.arange(0, BLOCK)
                m = i < row_elems
                x = tl.load(src_ptr + t * stride_src_t + i, mask=m)
                tl.store(dst_ptr + blk * stride_dst_b + off * stride_dst_t + i, x, mask=m)

    @triton.jit
    def _paged_attention_kernel(  # type: ignore[no-untyped-def]
        out_ptr,
        part_m_ptr,
        part_l_ptr,
        part_acc_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        qsl_ptr,
        seq_lens_ptr,
        bt_ptr,
        scale,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_kd,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_vd,
        stride_sb,
        stride_st,
        stride_sh,
        stride_bt,
        block_size,
        group,
        head_dim,
        num_heads,
        split_keys,
        SPLIT: tl.constexpr,
        QUANT: tl.constexpr,
        FP8: tl.constexpr,
        PRECISION: tl.constexpr,
        DOT_F32: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        G_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        # axis 2: query tiles; for a split decode (one query token) the context split instead
        tile = 0 if SPLIT else tl.program_id(2)
        split = tl.program_id(2) if SPLIT else 0
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + seq)
        tok0 = tile * BLOCK_Q
        if tok0 < q_len:
            rows = tl.arange(0, BLOCK_M)
            tok = tok0 + rows // G_PAD  # query token within the sequence
            g = rows % G_PAD
            head = kvh * group + g
            row_ok = (tok < q_len) & (g < group) & (rows < BLOCK_Q * G_PAD)
            d = tl.arange(0, BLOCK_D)
            d_ok = d < head_dim
            q_off = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
            # tensor-core dots in the model's dtype; float32 models get exact ("ieee") float32 dots
            q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            if DOT_F32:
                q = q.to(tl.float32)
            qpos = seq_len - q_len + tok  # absolute position of each query row
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            # the last key any row of this tile may see
            last_tok = tl.minimum(tok0 + BLOCK_Q, q_len) - 1
            kv_end = seq_len - q_len + last_tok + 1
            if SPLIT:
                kv_lo = split * split_keys
                kv_hi = tl.minimum(kv_end, kv_lo + split_keys)
            else:
                kv_lo = 0
                kv_hi = kv_end
            for n0 in range(kv_lo, kv_hi, BLOCK_N):
                kpos = n0 + tl.arange(0, BLOCK_N)
                k_ok = kpos < kv_hi
                blk = tl.load(bt_ptr + seq * stride_bt + kpos // block_size, mask=k_ok, other=0)
                blk = blk.to(tl.int64)
                off = kpos % block_size
                kk_off = blk[:, None] * stride_kb + off[:, None] * stride_kt + kvh * stride_kh
                vv_off = blk[:, None] * stride_vb + off[:, None] * stride_vt + kvh * stride_vh
                kv_mask = k_ok[:, None] & d_ok[None, :]
                if FP8:
                    k = tl.load(k_ptr + kk_off + d[None, :] * stride_kd, mask=kv_mask, other=0)
                    v = tl.load(v_ptr + vv_off + d[None, :] * stride_vd, mask=kv_mask, other=0)
                    k = k.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                    v = v.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                else:
                    k = tl.load(k_ptr + kk_off + d[None, :] * stride_kd, mask=kv_mask, other=0).to(tl.float32)
                    v = tl.load(v_ptr + vv_off + d[None, :] * stride_vd, mask=kv_mask, other=0).to(tl.float32)
                if QUANT:
                    s_off = blk * stride_sb + off * stride_st + kvh * stride_sh
                    k_s = tl.load(ks_ptr + s_off, mask=k_ok, other=0.0).to(tl.float32)
                    v_s = tl.load(vs_ptr + s_off, mask=k_ok, other=0.0).to(tl.float32)
                    k = k * k_s[:, None]
                    v = v * v_s[:, None]
                k = k.to(q.dtype)
                v = v.to(q.dtype)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                visible = (kpos[None, :] <= qpos[:, None]) & k_ok[None, :] & row_ok[:, None]
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
            if SPLIT:  # unnormalized partials of this part of the context; combined by _combine_splits
                num_splits = tl.num_programs(2)
                row = ((q_start + tok) * num_heads + head) * num_splits + split
                tl.store(part_m_ptr + row, m_i, mask=row_ok)
                tl.store(part_l_ptr + row, l_i, mask=row_ok)
                a_off = row[:, None] * head_dim + d[None, :]
                tl.store(part_acc_ptr + a_off, acc, mask=row_ok[:, None] & d_ok[None, :])
            else:
                l_safe = tl.where(l_i == 0.0, 1.0, l_i)
                o = acc / l_safe[:, None]
                o_off = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
                tl.store(
                    out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :]
                )


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """float8 tensors travel as uint8 (the kernel bitcasts); everything else as is."""
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


def _store_rows(src: torch.Tensor, dst: torch.Tensor, slots: torch.Tensor) -> None:
    """src [T, *row] contiguous -> dst [num_blocks, block_size, *row] (rows contiguous) at slots."""
    t = src.shape[0]
    if t == 0:
        return
    row = src[0].numel()
    if dst.stride(1) != row or not dst[0, 0].is_contiguous():
        raise ValueError("store_kv needs each token's row contiguous in the pool")
    s, d = _bytes(src.contiguous()).reshape(t, row), _bytes(dst)
    _store_kv_kernel[(t,)](s, d, slots, row, s.stride(0), d.stride(0), d.stride(1), dst.shape[1], BLOCK=256)


def store_kv(k: torch.Tensor, v: torch.Tensor, cache: KVCacheLayer, slot_mapping: torch.Tensor) -> None:
    """Write new keys/values [T, Hkv, D] into their slots; slot -1 rows are skipped in the kernel.
    Quantized pools: quantized with kernels/quant.py first (the same rounding as the reference)."""
    if cache.k_scale is not None:
        assert cache.v_scale is not None
        kq, ks = quant.quantize(k, cache.k.dtype)
        vq, vs = quant.quantize(v, cache.v.dtype)
        _store_rows(ks, cache.k_scale, slot_mapping)
        _store_rows(vs, cache.v_scale, slot_mapping)
    else:
        kq, vq = k.to(cache.k.dtype), v.to(cache.v.dtype)
    _store_rows(kq, cache.k, slot_mapping)
    _store_rows(vq, cache.v, slot_mapping)


# Decode steps over contexts longer than this many keys are split across programs (flash-decoding):
# each part of the context gets its own program per (sequence, KV head), partial softmax results are
# combined after. Without it a batch-1 decode runs only one program per KV head.
SPLIT_KEYS = 512
MAX_SPLITS = 32
# enough programs to fill a big GPU several times over (an H200 has 132 SMs): batches that already
# launch this many (sequence, KV head) programs are not split
TARGET_PROGRAMS = 1024


def split_plan(meta: AttentionMetadata, num_kv_heads: int, split_keys: int = SPLIT_KEYS) -> tuple[int, int]:
    """Pure: (parts, keys per part) a decode step's context is split into; (1, 0) for no split (prefill,
    short contexts, batches that fill the GPU already). Parts hold at least `split_keys` keys, are a
    multiple of BLOCK_N, and are at most MAX_SPLITS (bounding the partials' memory)."""
    if meta.max_query_len != 1 or meta.max_seq_len <= split_keys:
        return 1, 0
    programs = meta.block_tables.shape[0] * num_kv_heads
    parts = min(-(-meta.max_seq_len // split_keys), MAX_SPLITS, max(1, TARGET_PROGRAMS // programs))
    if parts <= 1:
        return 1, 0
    keys = -(-meta.max_seq_len // parts)
    keys = -(-keys // BLOCK_N) * BLOCK_N
    return -(-meta.max_seq_len // keys), keys


def _combine_splits(
    m: torch.Tensor, denom: torch.Tensor, acc: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Partials m (running max), denom (softmax denominator) [T, Hq, S] and acc [T, Hq, S, D]
    (unnormalized) -> [T, Hq, D]. Parts past a sequence's end hold m = -inf, denom = 0."""
    top = m.amax(-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp(m - top)  # exp(-inf) = 0 for empty parts
    total = (w * denom).sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return ((w.unsqueeze(-1) * acc).sum(-2) / total).to(dtype)


def paged_attention(
    q: torch.Tensor,
    cache: KVCacheLayer,
    meta: AttentionMetadata,
    scale: float,
    split_keys: int = SPLIT_KEYS,
) -> torch.Tensor:
    """q [T, Hq, D] over the cached context (already written) -> [T, Hq, D]. Reads tensors, plus
    meta.max_query_len and (decode) meta.max_seq_len for the number of context splits: a CUDA graph
    captures a decode step with max_seq_len at its upper bound (parts past a sequence's end exit)."""
    t, hq, dim = q.shape
    _, bs, hkv, _ = cache.k.shape
    if hq % hkv != 0:
        raise ValueError(f"{hq} query heads do not group over {hkv} KV heads")
    group = hq // hkv
    out = torch.empty_like(q)
    if t == 0:
        return out
    block_q, g_pad, block_m = tile_shape(group, meta.max_query_len)
    k, v = _bytes(cache.k), _bytes(cache.v)
    quantized = cache.k_scale is not None
    ks = cache.k_scale if quantized else k
    vs = cache.v_scale if quantized else v
    assert ks is not None and vs is not None
    s_strides = (ks.stride(0), ks.stride(1), ks.stride(2)) if quantized else (0, 0, 0)
    bt = meta.block_tables
    splits, keys_per_split = split_plan(meta, hkv, split_keys)
    if splits > 1:
        part_m = torch.empty(t, hq, splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(t, hq, splits, dim, dtype=torch.float32, device=q.device)
        grid = (bt.shape[0], hkv, splits)
    else:
        part_m = part_l = part_acc = out  # unused
        grid = (bt.shape[0], hkv, triton.cdiv(meta.max_query_len, block_q))
    _paged_attention_kernel[grid](
        out,
        part_m,
        part_l,
        part_acc,
        q,
        k,
        v,
        ks,
        vs,
        meta.query_start_loc,
        meta.seq_lens,
        bt,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k.stride(),
        *v.stride(),
        *s_strides,
        bt.stride(0),
        bs,
        group,
        dim,
        hq,
        keys_per_split,
        SPLIT=splits > 1,
        QUANT=quantized,
        FP8=cache.k.dtype == torch.float8_e4m3fn,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # Triton 3.x's interpreter (CPU tensors) computes bfloat16 dots wrongly; float32 there
        DOT_F32=q.device.type == "cpu" and q.dtype == torch.bfloat16,
        BLOCK_Q=block_q,
        G_PAD=g_pad,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_D=_next_pow2(dim),
    )
    if splits > 1:
        return _combine_splits(part_m, part_l, part_acc, q.dtype)
    return out


class TritonPagedAttentionBackend:
    """Triton paged attention on CUDA (and on the CPU under TRITON_INTERPRET=1, for tests)."""

    name = "triton"
    graph_safe = True  # reads lengths from tensors only: a decode step can be captured in a CUDA graph

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCacheLayer,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store_kv(k, v, cache, meta.slot_mapping)
        return paged_attention(q.contiguous(), cache, meta, scale)
