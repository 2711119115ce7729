"""Weight-only quantized matmul in Triton: out = x @ dequant(W)^T (+ bias), W kept int8 or int4.

The GPU side of kernels/qlinear.py (its docstring has the formats): `qlinear.matmul` takes this kernel
for CUDA tensors when `applies` says so, instead of dequantizing the whole weight every call and
calling torch's matmul. One program computes a [BLOCK_M, BLOCK_N] tile of out: it walks K, loads the
x tile (fp16/bf16/fp32, as given) and the matching tile of quantized codes with the group's float16
scale (and min) for its BLOCK_N output channels, dequantizes the codes in registers to x's dtype
(q * scale, or q * scale + min, in float32, rounded once: the values QuantizedWeight.dequantize gives)
and accumulates tl.dot in float32. float32 activations use exact float32 dots (no TF32).

* int8 [N, K]: K steps of BLOCK_K codes; BLOCK_K divides the group (or the group is all of K, one
  scale per channel), so a step needs one scale per channel. K that is not a multiple of BLOCK_K is
  masked.
* int4 [N, K / 2]: a group of g weights is g / 2 bytes, byte i holding weight i (low nibble) and
  weight i + g / 2 (high nibble). A step reads BLOCK_K bytes of one group (BLOCK_K divides g / 2)
  once and makes two dots: the low nibbles against x's columns j.., the high ones against j + g / 2...

Tiles (`tile_shape`) follow the row count: decode (up to 16 rows) uses 16-row tiles (tl.dot's
minimum) and narrow 32-column ones so a decode step still spreads over many programs; up to 64
rows 64 x 64, prefill 64 x 128. Chosen by reasoning, not autotuned or measured (no GPU has run it). No host synchronization, so the call can sit inside a CUDA graph.

Tested on the CPU under Triton's interpreter against qlinear.reference_matmul (dequantize + matmul),
and on CUDA by the same tests when a GPU is there (tests/kernels/test_triton_qlinear.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvpilot.kernels.qlinear import QuantizedWeight

try:  # triton ships with torch on Linux; absent elsewhere (macOS wheels)
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    HAVE_TRITON = False

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_BLOCK_K = 16  # tl.dot needs at least 16 along K


def available() -> bool:
    return HAVE_TRITON


def block_k(qw: QuantizedWeight) -> int | None:
    """K codes (int8) or bytes (int4) per step: a power of two from 16 to 32 that keeps a step inside
    one group; None when the format has none (an int8 group that is neither K nor a multiple of 16)."""
    if qw.bits == 8:
        if qw.group == qw.in_features:  # per channel: one scale for all of K
            return 32
        return next((b for b in (32, 16) if qw.group % b == 0), None)
    half = qw.group // 2
    return next((b for b in (32, 16) if half % b == 0), None)


def unsupported(qw: QuantizedWeight) -> str | None:
    """Why the kernel cannot take this weight (None when it can)."""
    if qw.bits not in (4, 8):
        return f"{qw.bits}-bit weights (the kernel takes 8 and 4)"
    if qw.in_features % qw.group or (qw.bits == 4 and qw.group % 2):
        return f"in_features {qw.in_features} is not a multiple of the group size {qw.group}"
    if block_k(qw) is None:
        return f"int{qw.bits} group size {qw.group} (int8: K or a multiple of 16; int4: a multiple of 32)"
    if qw.bits == 4 and qw.mins is None:
        return "int4 weights without mins"
    return None


def applies(x: torch.Tensor, qw: QuantizedWeight) -> bool:
    """Whether qlinear.matmul takes this kernel: CUDA tensors on one device, fp16/bf16/fp32, Triton."""
    return (
        HAVE_TRITON
        and x.device.type == "cuda"
        and qw.packed.device == x.device
        and x.dtype in DTYPES
        and x.shape[-1] == qw.in_features
        and unsupported(qw) is None
    )


def tile_shape(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for m rows: decode tiles for up to 16 rows, then wider ones."""
    if m <= 16:
        return 16, 32, 4
    if m <= 64:
        return 64, 64, 4
    return 64, 128, 8


if HAVE_TRITON:
    # the row count changes every step (one compiled variant for all of them); the shapes stay specialized
    @triton.jit(do_not_specialize=["m_size"])
    def _qmatmul_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: typed by the JIT
        x_ptr,
        w_ptr,
        scale_ptr,
        min_ptr,
        bias_ptr,
        out_ptr,
        m_size,
        n_size,
        k_size,
        group,
        stride_xm,
        stride_om,
        BITS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        PRECISION: tl.constexpr,
        DOT_F32: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r_ok = rows < m_size
        c_ok = cols < n_size
        cols64 = cols.to(tl.int64)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        groups = k_size // group
        s_row = scale_ptr + cols64 * groups  # [BLOCK_N]: each channel's first scale (and min)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if BITS == 8:
            w_cols = w_ptr + cols64[None, :] * k_size
            for k0 in range(0, k_size, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < k_size
                a = tl.load(x_rows + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
                q = tl.load(w_cols + ks[:, None], mask=c_ok[None, :] & k_ok[:, None], other=0)
                s = tl.load(s_row + k0 // group, mask=c_ok, other=0.0).to(tl.float32)
                w = (q.to(tl.float32) * s[None, :]).to(x_ptr.dtype.element_ty)
                if DOT_F32:
                    a = a.to(tl.float32)
                    w = w.to(tl.float32)
                acc += tl.dot(a, w, input_precision=PRECISION)
        else:
            half = group // 2
            row_bytes = k_size // 2
            w_cols = w_ptr + cols64[None, :] * row_bytes
            m_row = min_ptr + cols64 * groups
            for b0 in range(0, row_bytes, BLOCK_K):
                g = b0 // half
                bs = b0 + tl.arange(0, BLOCK_K)
                p = tl.load(w_cols + bs[:, None], mask=c_ok[None, :], other=0)
                s = tl.load(s_row + g, mask=c_ok, other=0.0).to(tl.float32)[None, :]
                mn = tl.load(m_row + g, mask=c_ok, other=0.0).to(tl.float32)[None, :]
                w_lo = ((p & 15).to(tl.float32) * s + mn).to(x_ptr.dtype.element_ty)
                w_hi = ((p >> 4).to(tl.float32) * s + mn).to(x_ptr.dtype.element_ty)
                k_lo = g * group + (b0 - g * half) + tl.arange(0, BLOCK_K)  # weights j.. of group g
                a_lo = tl.load(x_rows + k_lo[None, :], mask=r_ok[:, None], other=0.0)
                a_hi = tl.load(x_rows + (k_lo + half)[None, :], mask=r_ok[:, None], other=0.0)
                if DOT_F32:
                    a_lo = a_lo.to(tl.float32)
                    a_hi = a_hi.to(tl.float32)
                    w_lo = w_lo.to(tl.float32)
                    w_hi = w_hi.to(tl.float32)
                acc += tl.dot(a_lo, w_lo, input_precision=PRECISION)
                acc += tl.dot(a_hi, w_hi, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        o = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & c_ok[None, :])


def qmatmul(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(W)^T (+ bias) -> [..., N] in x's dtype (CUDA, or CPU under the interpreter)."""
    if not HAVE_TRITON:
        raise RuntimeError("the quantized Triton matmul needs triton")
    n, k = qw.out_features, qw.in_features
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {k}")
    if x.dtype not in DTYPES:
        raise ValueError(f"activations are {x.dtype}; the kernel takes float16, bfloat16 or float32")
    reason = unsupported(qw)
    if reason:
        raise ValueError(f"the quantized Triton matmul cannot take {reason}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({n},)")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*x.shape[:-1], n)
    bk = block_k(qw)
    assert bk is not None  # unsupported() said so
    block_m, block_n, warps = tile_shape(m)
    packed, scales = qw.packed.contiguous(), qw.scales.contiguous()
    mins = scales if qw.mins is None else qw.mins.contiguous()  # int8: never read
    b = None if bias is None else bias.contiguous()
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _qmatmul_kernel[grid](
        x2,
        packed,
        scales,
        mins,
        out if b is None else b,  # no bias: a pointer never read
        out,
        m,
        n,
        k,
        qw.group,
        x2.stride(0),
        out.stride(0),
        BITS=qw.bits,
        HAS_BIAS=b is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        # Triton 3.x's interpreter (CPU tensors) computes bfloat16 dots wrongly; float32 there
        DOT_F32=x.device.type == "cpu" and x.dtype == torch.bfloat16,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=bk,
        num_warps=warps,
    )
    return out.reshape(*x.shape[:-1], n)
