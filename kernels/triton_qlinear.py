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

Up to 64 rows 64 x 64 tiles, prefill 64 x 128 (`tile_shape`). Decode (up to DECODE_MAX_M rows) takes a
second kernel, `_qgemv_splitk_kernel`: at batch 1 the tile kernel read an 8B-shaped model's int4 weights
at 342 GB/s on an H200 in its first GPU run (half the bfloat16 path's speed): one 16 x 32 program per 32
channels walked all of K 16 bytes at a time. The decode kernel splits K across programs (`decode_split`,
about four programs per SM) and reads whole BLOCK_KB-byte spans of each channel's row, several groups at
once (each byte's scale and min gathered by its group), writing float32 partial sums that one torch sum
adds up (deterministic: no atomics). Measured (benchmarks/micro/triton_qmatmul.py, DECODE below): 1.5x
the tile kernel, still about half of torch's bfloat16 matmul on the dequantized weights, which reads 4x
(int4) or 2x (int8) the bytes: the dequantization in registers and a 16-row tl.dot for one row cost more
than the bytes saved; closing that needs a weight layout made for the tensor cores (as Marlin's).
No host synchronization in either, so the call can sit inside a CUDA graph.

Tested on the CPU under Triton's interpreter against qlinear.reference_matmul (dequantize + matmul),
and on CUDA by the same tests when a GPU is there (tests/kernels/test_triton_qlinear.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
    """(BLOCK_M, BLOCK_N, num_warps) of the tile kernel for m rows."""
    if m <= 16:
        return 16, 32, 4
    if m <= 64:
        return 64, 64, 4
    return 64, 128, 8


DECODE_MAX_M = 16  # rows up to which the split-K decode kernel runs (one 16-row tl.dot tile)


@dataclass(frozen=True)
class DecodeConfig:
    """The split-K decode kernel's tile: BLOCK_N channels x BLOCK_KB bytes (int4) or codes (int8)."""

    block_n: int = 64
    block_kb: int = 64
    num_warps: int = 4
    num_stages: int = 4
    target_programs: int = 264  # twice an H200's 132 SMs; decode_split aims at least this many


# Per bit width, the fastest of benchmarks/micro/triton_qmatmul.py's configurations on an H200 (8B shapes,
# a token's linear layers at 1 and 16 rows; the 64 x 64 default above, wider spans, more programs, a
# variant without tl.dot that summed a [rows, channels, bytes] product: 2-4x slower, dropped). int4: 128-
# byte spans, 528 programs: 10.0 / 10.2 ms (the tile kernel 15.4 / 13.5 ms); int8: 528 programs: 8.0 /
# 8.7 ms (tiles 12.6 / 12.6 ms). torch's bfloat16 matmul on the dequantized weights: 4.9 ms.
DECODE: dict[int, DecodeConfig] = {
    4: DecodeConfig(block_kb=128, target_programs=528),
    8: DecodeConfig(target_programs=528),
}


def decode_split(n: int, k_units: int, cfg: DecodeConfig) -> tuple[int, int]:
    """Pure: (splits of K, units of K per split) so that N / block_n x splits programs reach
    cfg.target_programs, each split a whole number of BLOCK_KB steps and at least two of them."""
    n_tiles = -(-n // cfg.block_n)
    steps = -(-k_units // cfg.block_kb)
    split = max(1, min(-(-cfg.target_programs // n_tiles), steps // 2))
    per = -(-steps // split) * cfg.block_kb
    return -(-k_units // per), per


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

    @triton.jit(do_not_specialize=["m_size"])
    def _qgemv_splitk_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: typed by the JIT
        x_ptr,
        w_ptr,
        scale_ptr,
        min_ptr,
        part_ptr,
        m_size,
        n_size,
        k_size,
        group,
        stride_xm,
        per_split,
        BITS: tl.constexpr,
        PRECISION: tl.constexpr,
        DOT_F32: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_KB: tl.constexpr,
    ):
        """part[split, m, n] = the float32 sum over this split's span of K (codes for int8, bytes for int4)."""
        split = tl.program_id(2)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r_ok = rows < m_size
        c_ok = cols < n_size
        cols64 = cols.to(tl.int64)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        groups = k_size // group
        s_cols = scale_ptr + cols64[None, :] * groups
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        units = k_size if BITS == 8 else k_size // 2
        start = split * per_split
        end = tl.minimum(start + per_split, units)
        w_cols = w_ptr + cols64[None, :] * units
        for u0 in range(start, end, BLOCK_KB):
            us = u0 + tl.arange(0, BLOCK_KB)
            u_ok = us < end
            wmask = c_ok[None, :] & u_ok[:, None]
            q = tl.load(w_cols + us[:, None], mask=wmask, other=0)  # [BLOCK_KB, BLOCK_N]
            if BITS == 8:
                s = tl.load(s_cols + (us // group)[:, None], mask=wmask, other=0.0).to(tl.float32)
                w = (q.to(tl.float32) * s).to(x_ptr.dtype.element_ty)
                a = tl.load(x_rows + us[None, :], mask=r_ok[:, None] & u_ok[None, :], other=0.0)
                if DOT_F32:
                    a = a.to(tl.float32)
                    w = w.to(tl.float32)
                acc += tl.dot(a, w, input_precision=PRECISION)
            else:
                half = group // 2
                g = us // half
                s = tl.load(s_cols + g[:, None], mask=wmask, other=0.0).to(tl.float32)
                mn = tl.load(min_ptr + cols64[None, :] * groups + g[:, None], mask=wmask, other=0.0)
                mn = mn.to(tl.float32)
                w_lo = ((q & 15).to(tl.float32) * s + mn).to(x_ptr.dtype.element_ty)
                w_hi = ((q >> 4).to(tl.float32) * s + mn).to(x_ptr.dtype.element_ty)
                k_lo = g * group + (us - g * half)  # byte j of group g: weights j and j + half
                amask = r_ok[:, None] & u_ok[None, :]
                a_lo = tl.load(x_rows + k_lo[None, :], mask=amask, other=0.0)
                a_hi = tl.load(x_rows + (k_lo + half)[None, :], mask=amask, other=0.0)
                if DOT_F32:
                    a_lo = a_lo.to(tl.float32)
                    a_hi = a_hi.to(tl.float32)
                    w_lo = w_lo.to(tl.float32)
                    w_hi = w_hi.to(tl.float32)
                acc += tl.dot(a_lo, w_lo, input_precision=PRECISION)
                acc += tl.dot(a_hi, w_hi, input_precision=PRECISION)
        o = part_ptr + (split * m_size + rows.to(tl.int64))[:, None] * n_size + cols64[None, :]
        tl.store(o, acc, mask=r_ok[:, None] & c_ok[None, :])


def _check_call(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The checks both kernels need; returns x as [M, K] with unit stride along K."""
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
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _precision(x: torch.Tensor) -> dict[str, Any]:
    return {
        "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
        # Triton 3.x's interpreter (CPU tensors) computes bfloat16 dots wrongly; float32 there
        "DOT_F32": x.device.type == "cpu" and x.dtype == torch.bfloat16,
    }


def qgemv(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, cfg: DecodeConfig | None = None
) -> torch.Tensor:
    """The split-K decode kernel: x [..., K] (up to DECODE_MAX_M rows) @ dequant(W)^T (+ bias)."""
    x2 = _check_call(x, qw, bias)
    m, n = x2.shape[0], qw.out_features
    if m > DECODE_MAX_M:
        raise ValueError(f"the decode kernel takes up to {DECODE_MAX_M} rows, not {m}")
    if m == 0 or n == 0:
        return torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    cfg = cfg or DECODE[qw.bits]
    units = qw.in_features if qw.bits == 8 else qw.in_features // 2
    split, per = decode_split(n, units, cfg)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    mins = qw.scales if qw.mins is None else qw.mins.contiguous()  # int8: never read
    grid = (1, triton.cdiv(n, cfg.block_n), split)
    _qgemv_splitk_kernel[grid](
        x2,
        qw.packed.contiguous(),
        qw.scales.contiguous(),
        mins,
        part,
        m,
        n,
        qw.in_features,
        qw.group,
        x2.stride(0),
        per,
        BITS=qw.bits,
        BLOCK_M=DECODE_MAX_M,
        BLOCK_N=cfg.block_n,
        BLOCK_KB=cfg.block_kb,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **_precision(x),
    )
    return _finish(part, bias, x)


def _finish(part: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The splits' float32 partial sums added (one torch sum), the bias, x's dtype and leading dims."""
    out = part.sum(0) if part.shape[0] > 1 else part[0]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], part.shape[-1])


def qmatmul(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(W)^T (+ bias) -> [..., N] in x's dtype (CUDA, or CPU under the interpreter):
    the split-K decode kernel up to DECODE_MAX_M rows, the tile kernel above."""
    rows = x.numel() // max(1, x.shape[-1])
    return qgemv(x, qw, bias) if 0 < rows <= DECODE_MAX_M else qmatmul_tiles(x, qw, bias)


def qmatmul_tiles(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The tile kernel, for any row count (qmatmul takes it above DECODE_MAX_M rows)."""
    x2 = _check_call(x, qw, bias)
    n, k = qw.out_features, qw.in_features
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
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=bk,
        num_warps=warps,
        **_precision(x),
    )
    return out.reshape(*x.shape[:-1], n)
